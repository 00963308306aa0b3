"""lockstep.dist.groups on 2 gloo processes: the groups of each layout, control-group agreement, and
that a hung or dead peer ends in DistributedError naming the rank and operation within the timeout."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_world import rank_values, run_world, shared_gpu, world_devices
from lockstep.dist.config import DistConfig
from lockstep.dist.groups import DistributedError, Layout, collective, computing, init_distributed


def _layout_world(rank, disaggregated):
    config = DistConfig(actor_num_gpus=1, rollout_num_gpus=1) if disaggregated else DistConfig()
    ctx = init_distributed(30.0, config=config)
    members = [g is not None for g in (ctx.trainer_group, ctx.engine_group, ctx.weight_group)]
    # the weight group carries a broadcast from the trainer source rank (NCCL for a GPU tensor)
    t = torch.tensor([float(rank + 7)], device=ctx.device)
    with ctx.collective("broadcast test"):
        dist.broadcast(t, src=ctx.weight_src, group=ctx.weight_group)
    agree = ctx.all_true(rank == 0, "flag")
    everyone = ctx.all_true(True, "flag")
    ctx.barrier("end")
    return dict(members=members, trainer=ctx.is_trainer, engine=ctx.is_engine, got=t.item(), agree=agree,
                everyone=everyone, device=str(ctx.device), backend=str(dist.get_backend_config()))


@pytest.mark.parametrize("device", world_devices())
@pytest.mark.parametrize("disaggregated", [False, True])
def test_groups_of_each_layout(disaggregated, device):
    r0, r1 = run_world(_layout_world, 2, guard_s=60, args=(disaggregated,), device=device)
    assert r0.ok and r1.ok, (r0.error, r1.error)
    if disaggregated:
        assert (r0.value["trainer"], r0.value["engine"]) == (True, False)
        assert (r1.value["trainer"], r1.value["engine"]) == (False, True)
        assert r0.value["members"] == [True, False, True] and r1.value["members"] == [False, True, True]
    else:
        assert r0.value["members"] == r1.value["members"] == [True, True, True]
        assert r0.value["engine"] and r1.value["trainer"]
    assert r0.value["got"] == r1.value["got"] == 7.0  # rank 0's value reached rank 1
    assert r0.value["agree"] is False and r1.value["agree"] is False  # one rank said no
    assert r0.value["everyone"] and r1.value["everyone"]
    if device == "cpu":
        assert r0.value["device"] == "cpu" and r0.value["backend"] == "cpu:gloo,cuda:gloo"
    elif shared_gpu():  # both ranks on the one GPU: NCCL refuses that, gloo carries the CUDA tensors
        assert (r0.value["device"], r1.value["device"]) == ("cuda:0", "cuda:0")
        assert r0.value["backend"] == "cpu:gloo,cuda:gloo", r0.value["backend"]
    else:  # one GPU a rank; NCCL for CUDA tensors, gloo for the CPU ones (the control group)
        assert (r0.value["device"], r1.value["device"]) == ("cuda:0", "cuda:1")
        assert r0.value["backend"] == "cpu:gloo,cuda:nccl", r0.value["backend"]


def _hung_peer_world(rank):
    ctx = init_distributed(2.0)
    if rank == 1:
        time.sleep(4)  # alive but never joins the barrier
        return "slept"
    ctx.barrier("before weight push")


def test_hung_peer_times_out_with_rank_and_operation():
    r0, r1 = run_world(_hung_peer_world, 2, guard_s=45)
    assert not r0.hung and r0.error_type == "DistributedError", r0.error
    assert "rank 0: barrier before weight push timed out after 2s" in r0.error
    assert r0.elapsed_s < 7, r0.elapsed_s  # the configured 2 s, not gloo's default
    assert r1.value == "slept"


def _dead_peer_world(rank):
    ctx = init_distributed(20.0)
    ctx.barrier("start")
    if rank == 1:
        os._exit(3)  # dies without a word to its peer
    time.sleep(0.5)
    ctx.barrier("after the peer died")


def test_dead_peer_raises_within_timeout():
    r0, r1 = run_world(_dead_peer_world, 2, guard_s=45)
    assert r1.exitcode == 3
    assert not r0.hung and r0.error_type == "DistributedError", r0.error
    assert "rank 0: barrier after the peer died" in r0.error
    assert r0.elapsed_s < 25, r0.elapsed_s


def test_init_without_launcher_env_says_how_to_launch(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(DistributedError, match="torchrun"):
        init_distributed(5.0)


def test_collective_wraps_runtime_errors_with_rank_and_op():
    with pytest.raises(DistributedError, match=r"rank 3: all_reduce grads failed after .*timeout 9s.*boom"):
        with collective("all_reduce grads", rank=3, timeout_s=9.0):
            raise RuntimeError("boom")
    with pytest.raises(ValueError):  # not a distributed failure: left alone
        with collective("x", rank=0, timeout_s=1.0):
            raise ValueError("bad shape")


def test_computing_names_a_collectives_failure_inside_and_lets_other_errors_by():
    """groups.computing (a train step, FSDP's collectives inside): gloo's transport error or torch's
    DistError becomes a DistributedError naming rank and operation ("failed after", never a timeout:
    the time is the computation's); a bug or an out-of-memory error passes as it is; a nested
    collective's DistributedError keeps its own operation."""
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    with pytest.raises(DistributedError, match=r"rank 1: the train step failed after .*a peer probably exited.*"
                                               r"Connection reset by peer") as failed:
        with computing("the train step", rank=1, timeout_s=1e-9):
            time.sleep(0.01)  # past the timeout: still not called one
            raise gloo
    assert failed.value.__cause__ is gloo and "timed out" not in str(failed.value)
    with pytest.raises(DistributedError, match="rank 0: the logprob forward failed after"):
        with computing("the logprob forward", rank=0, timeout_s=5.0):
            raise dist.DistNetworkError("store connection lost")
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(RuntimeError) as passed:
        with computing("the train step", rank=0, timeout_s=5.0):
            raise oom
    assert passed.value is oom
    with pytest.raises(DistributedError, match="rank 2: all_reduce grad norm failed"):
        with computing("the train step", rank=2, timeout_s=5.0):
            with collective("all_reduce grad norm", rank=2, timeout_s=5.0):
                raise RuntimeError("boom")


def _sigterm() -> str:
    """SIGTERM this process as torch's launcher does; the DistributedError it raises, or "ignored"."""
    import signal

    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)  # the handler runs at the next bytecode
    except DistributedError as e:
        return str(e)
    return "ignored"


def _launcher_stopped_rank(rank):
    import signal

    from lockstep.dist import groups

    os.environ["TORCHELASTIC_RUN_ID"] = "test"  # as in a torchrun-started process
    ctx = init_distributed(10.0)
    ctx.barrier("before")
    after = _sigterm()
    signal.signal(signal.SIGTERM, groups._on_launcher_stop)  # it ignores the signal after once
    try:
        with ctx.collective("all_reduce x"):
            inside = _sigterm()
    except DistributedError as e:
        inside = str(e)
    signal.signal(signal.SIGTERM, groups._on_launcher_stop)
    try:
        with ctx.collective("all_reduce y"):
            raise RuntimeError("Connection closed by peer")
    except DistributedError:
        pass
    signal.signal(signal.SIGTERM, groups._on_launcher_stop)
    return {"after": after, "inside": inside, "after_a_failure": _sigterm()}


def test_launcher_sigterm_raises_naming_the_rank_and_its_last_collective():
    got = rank_values(run_world(_launcher_stopped_rank, 1, guard_s=30))[0]
    assert got["after"].startswith("rank 0: stopped by the launcher (SIGTERM) after barrier before: another rank "
                                   "failed"), got
    assert got["inside"].startswith("rank 0: stopped by the launcher (SIGTERM) in all_reduce x:"), got
    assert got["after_a_failure"] == "ignored", got  # the failed collective's error is the one that leaves


def test_layout_and_config_validation():
    assert Layout.disaggregated(3, 1).weight_ranks == (0, 3)
    assert Layout.colocated(2).is_colocated
    with pytest.raises(ValueError, match="world size 3"):
        Layout.from_config(DistConfig(actor_num_gpus=1, rollout_num_gpus=1), 3)
    with pytest.raises(ValueError, match="DistConfig.actor_num_gpus"):
        DistConfig(actor_num_gpus=1)
    with pytest.raises(ValueError, match="DistConfig.distributed_timeout"):
        DistConfig(distributed_timeout=0)


def test_every_dist_flag_is_documented():
    import argparse
    import dataclasses

    from lockstep.cli_args import add_dataclass_arguments, field_docs

    docs = field_docs(DistConfig)
    assert all(docs.get(f.name) for f in dataclasses.fields(DistConfig)), docs
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, DistConfig)
    args = parser.parse_args(["--distributed-timeout", "30", "--actor-num-gpus", "1", "--rollout-num-gpus", "1"])
    assert (args.distributed_timeout, args.actor_num_gpus) == (30.0, 1)


@pytest.mark.parametrize("local_world, gpus, want", [(2, 2, "cpu:gloo,cuda:nccl"), (2, 1, "gloo"),
                                                     (1, 1, "cpu:gloo,cuda:nccl"), (8, 4, "gloo")])
def test_ranks_sharing_a_gpu_use_gloo(monkeypatch, local_world, gpus, want):
    """NCCL refuses two ranks on one GPU: more local ranks than GPUs puts CUDA tensors on gloo."""
    from lockstep.dist import groups

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert groups._default_backend(torch.device("cuda", 0)) == want
    assert groups._default_backend(torch.device("cpu")) == "gloo"
