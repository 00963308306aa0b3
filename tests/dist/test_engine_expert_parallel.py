"""Expert-parallel engine with data-parallel attention (lockstep/dist/engine_expert_parallel.py):
2 gloo processes, the bundled tiny DeepSeek-V4 (8 routed experts a layer, 4 kept per rank).

Each rank serves its own requests; the experts are sharded, so every forward exchanges rows with the
peer. Checked against ONE engine in this process given the same rank's requests (no batch-invariant
mode: the exchange computes each source rank's rows in GEMMs of their own, so a rank's batch is
computed as one engine computes it): token ids, finish reasons and routed experts equal, logprobs
bitwise, greedy and seeded sampling, fp32 (bf16 serving format) and bf16 (fp8-fp4: fp4 experts). Rounds: unequal load (rank 0 several prompts of
different lengths, rank 1 one short one), then rank 1 with nothing at all (empty steps until rank 0
is done), then after a weight push. Memory: each rank's expert parameters are half the full bytes,
in storage of their own. Weight push (`push_weights`, two-phase commit): each rank's expert shard
equals the slice of what one engine serves after the same in-process update, every other tensor
equal; a stale version, and a NaN in one rank's experts, are voted down and change nothing. A peer that exits mid-generation makes
the survivor raise DistributedError naming its rank and the operation; a peer whose sampling fails
stops the other at the next step, naming the failed rank. Built from the checkpoint with each rank's
experts only (`expert_parallel_engine_from_pretrained`, the windowed load), an EP engine serves
bitwise what one built from the full model serves, holding the same tensors.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import pytest
import torch

import lockstep
from dist_world import rank_values, run_world
from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine.request import GenerateRequest

ASSET = Path(lockstep.__file__).parent / "assets" / "tiny-dsv4"
VOCAB = 103


def _requests(rank: int, round_: str) -> list[GenerateRequest]:
    """rank 0: prompts of 2..9 tokens, greedy and seeded; rank 1: one short prompt, or none when idle."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, return_routed_experts=True, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, n=2, max_new_tokens=5, return_routed_experts=True)
    g = torch.Generator().manual_seed(100 + rank)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 2, 9, 3)]
    if rank == 1:
        return [] if round_ == "idle" else [GenerateRequest(prompts[1], greedy)]
    return [GenerateRequest(p, greedy if i % 2 == 0 else seeded) for i, p in enumerate(prompts)]


def _config(dtype: str) -> EngineConfig:
    # bf16 serves fp8 attention and fp4 experts (a 284B MoE's serving format): quantised shards too
    fmt = "fp8-fp4" if dtype == "bfloat16" else "bf16"
    return EngineConfig(max_num_seqs=8, max_model_len=32, dtype=dtype, max_prefill_tokens=12, serving_format=fmt)


def _digest(samples) -> list:
    return [(s.response_ids.tolist(), s.rollout_logprobs.clone(), s.finish_reason, s.routed_experts.clone())
            for s in samples]


def _new_weights(model) -> dict[str, torch.Tensor]:
    """The full model's tensors, moved a little (what a trainer step would push)."""
    g = torch.Generator().manual_seed(5)
    return {n: (t + 1e-2 * torch.randn(t.shape, generator=g)).to(t.dtype) if t.is_floating_point() else t.clone()
            for n, t in model.state_dict().items()}


def _expert_bytes(model) -> tuple[int, int]:
    """(bytes of the routed-expert parameters, bytes of their storages): equal if nothing else is kept."""
    from lockstep.models.layers.moe import Experts

    ps = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)]
    return sum(p.numel() * p.element_size() for p in ps), sum(p.untyped_storage().nbytes() for p in ps)


def _record_kernel_kinds(engine) -> list[bool]:
    """The decode flag of every local expert MLP call from now on (the kernel choice on GPUs)."""
    kinds = []
    for experts in engine.experts:
        def mlp(xs, counts, decode=False, inner=experts.mlp):
            kinds.append(decode)
            return inner(xs, counts, decode)
        experts.mlp = mlp
    return kinds


NAN_EXPERTS = "model.layers.1.mlp.experts.gate_up_proj"


def _push(ctx, engine, weights, version: int):
    from lockstep.dist.manifest import build_manifest
    from lockstep.dist.weight_push import push_weights
    from lockstep.models import load_pretrained

    manifest = build_manifest(load_pretrained(ASSET), torch.float32, 1 << 20)  # the full model's
    return push_weights(ctx, manifest, version, named_tensors=list(weights.items()), engine=engine)


def _ep_rank(rank: int, dtype: str, push: bool) -> dict:
    from lockstep.dist.engine_expert_parallel import expert_parallel_engine
    from lockstep.dist.groups import init_distributed
    from lockstep.dist.weight_push import WeightPushError
    from lockstep.models import load_pretrained

    ctx = init_distributed(20.0)
    engine = expert_parallel_engine(ctx, load_pretrained(ASSET), _config(dtype))
    out = {"uneven": _digest(engine.generate(_requests(rank, "uneven")))}
    out["uneven_empty"] = engine.empty_forward_calls
    kinds = _record_kernel_kinds(engine)
    out["idle"] = _digest(engine.generate(_requests(rank, "idle")))
    out["idle_kinds"] = set(kinds)
    out["idle_empty"], out["bytes"] = engine.empty_forward_calls - out["uneven_empty"], _expert_bytes(engine.model)
    if push:
        _push(ctx, engine, _new_weights(load_pretrained(ASSET)), version=3)
        try:
            _push(ctx, engine, _new_weights(load_pretrained(ASSET)), version=2)  # stale: voted down
        except WeightPushError as e:
            out["stale"] = str(e)
        bad = _new_weights(load_pretrained(ASSET))
        bad[NAN_EXPERTS][5, 0, 0] = float("nan")  # expert 5: in rank 1's slice only
        try:
            _push(ctx, engine, bad, version=4)
        except WeightPushError as e:
            out["nan"] = str(e)
        out["state"] = {n: t.clone() for n, t in engine.model.state_dict().items()}
        out["version"] = engine.weight_version
        out["kept_alive"] = _streamed_update(engine, _new_weights(load_pretrained(ASSET)))
        out["pushed"] = _digest(engine.generate(_requests(rank, "uneven")))
    return out


def _streamed_update(engine, weights: dict) -> list[str]:
    """A colocated update from a generator of fresh tensors, as FSDP's and the pipeline's gathers yield
    them: the full expert tensors still alive once the update has moved past them (after the version
    check: an in-process update equal to the push's weights)."""
    alive, refs = [], []

    def fresh():
        for name, t in weights.items():  # a tensor is freed when its last reference goes (no gc pass)
            alive.extend(n for n, ref in refs if ref() is not None)
            refs.clear()
            t = t.clone()
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                refs.append((name, weakref.ref(t)))
            yield name, t

    engine.update_weights(fresh(), version=5)
    return alive


def _one_engine(dtype: str):
    from lockstep.engine.engine import Engine
    from lockstep.models import load_pretrained

    return Engine(load_pretrained(ASSET), _config(dtype))


def _assert_same(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0] and g[2] == w[2], f"{what} sample {i}: tokens {g[0]} != {w[0]}"
        assert torch.equal(g[1], w[1]), f"{what} sample {i}: logprobs {g[1]} != {w[1]}"
        assert torch.equal(g[3], w[3]), f"{what} sample {i}: routed experts differ"


_WORLDS: dict[str, list] = {}


def _world(dtype: str) -> list:
    """Each rank's results of one 2-process world (run once per dtype; fp32 also pushes weights)."""
    if dtype not in _WORLDS:
        _WORLDS[dtype] = rank_values(run_world(_ep_rank, 2, guard_s=60, args=(dtype, dtype == "float32")))
    return _WORLDS[dtype]


DTYPES = pytest.mark.parametrize("dtype", ["float32", "bfloat16"])


@DTYPES
def test_ep_engine_generates_bitwise_what_one_engine_generates_per_rank(dtype):
    torch.set_num_threads(1)
    ranks = _world(dtype)
    one = _one_engine(dtype)
    for rank, got in enumerate(ranks):
        for round_ in ("uneven", "idle"):
            want = _digest(one.generate(_requests(rank, round_)))
            _assert_same(got[round_], want, f"{dtype} rank {rank} round {round_}")
    assert len(ranks[0]["uneven"]) == 6 and len(ranks[1]["uneven"]) == 1 and ranks[1]["idle"] == []
    # rank 1 took part in rank 0's steps without work: forwards of its own done, or none at all
    assert ranks[1]["uneven_empty"] > 0 and ranks[1]["idle_empty"] > 0 and ranks[0]["idle_empty"] == 0
    # idle rank 1 computed rank 0's prefill and decode rows, each with the kernel of rank 0's step kind
    assert ranks[1]["idle_kinds"] == {False, True}
    assert len({len(s[0]) for s in ranks[0]["uneven"]}) > 1  # seeded samples stop at different lengths


@DTYPES
def test_each_rank_keeps_half_of_the_expert_bytes(dtype):
    ranks = _world(dtype)
    full, _ = _expert_bytes(_one_engine(dtype).model)
    for rank, got in enumerate(ranks):
        params, storage = got["bytes"]
        assert params * 2 == full and storage == params, (rank, got["bytes"], full)


def test_weight_push_into_ep_engines_equals_an_in_process_update():
    torch.set_num_threads(1)
    dtype, ranks = "float32", _world("float32")
    from lockstep.models import load_pretrained

    one = _one_engine(dtype)
    one.update_weights(_new_weights(load_pretrained(ASSET)), version=3)
    want = one.model.state_dict()
    for rank, got in enumerate(ranks):
        assert got["version"] == 3 and "aborted" in got["stale"] and "rank(s) [0, 1]" in got["stale"]
        # a NaN in expert 5 fails rank 1's staging only (each rank checks its slice); the vote stops both
        assert "aborted, rank(s) [1] failed" in got["nan"] and "keep version 3" in got["nan"], got["nan"]
        assert (NAN_EXPERTS in got["nan"]) == (rank == 1), got["nan"]
        assert set(got["state"]) == set(want)
        for name, t in got["state"].items():
            expected = want[name]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                expected = expected[rank * 4:(rank + 1) * 4]
            assert torch.equal(t, expected), f"rank {rank}: {name}"
        _assert_same(got["pushed"], _digest(one.generate(_requests(rank, "uneven"))), f"rank {rank} after the push")
        # a colocated update keeps this rank's slice of each full expert tensor, not the full tensor
        assert got["kept_alive"] == [], got["kept_alive"]


def _dying_rank(rank: int) -> None:
    from lockstep.dist.engine_expert_parallel import expert_parallel_engine
    from lockstep.dist.groups import init_distributed
    from lockstep.models import load_pretrained

    ctx = init_distributed(30.0)
    engine = expert_parallel_engine(ctx, load_pretrained(ASSET), _config("float32"))
    if rank == 1:
        agree = engine.agree_step

        def die_at_step_4(forwards: int) -> int:
            if engine.steps == 3:
                os._exit(3)  # mid-generation: rank 0 still has requests running
            return agree(forwards)
        engine.agree_step = die_at_step_4
    engine.generate(_requests(rank, "uneven"))


def test_a_peer_dying_mid_generation_raises_naming_rank_and_operation():
    r0, r1 = run_world(_dying_rank, 2, guard_s=60)
    assert r1.exitcode == 3 and not r0.hung
    assert r0.error_type == "DistributedError", r0.error
    first = r0.error.splitlines()[0]
    assert first.startswith("rank 0: ") and "expert-parallel" in first and "a peer probably exited" in first, first
    assert r0.elapsed_s < 30, r0.elapsed_s  # at once, not at the 30 s timeout (start-up included)


def test_the_ep_engine_is_refused_outside_the_colocated_layout():
    from lockstep.dist.config import DistConfig

    with pytest.raises(ValueError, match="rollout_expert_parallel_size: 2: the expert-parallel engine runs colocated"):
        DistConfig(nproc_per_node=2, actor_num_gpus=1, rollout_num_gpus=1, rollout_expert_parallel_size=2)
    assert DistConfig(nproc_per_node=2, rollout_expert_parallel_size=2).rollout_expert_parallel_size == 2


def _failing_rank(rank: int) -> None:
    from lockstep.dist.engine_expert_parallel import expert_parallel_engine
    from lockstep.dist.groups import init_distributed
    from lockstep.models import load_pretrained

    ctx = init_distributed(30.0)
    engine = expert_parallel_engine(ctx, load_pretrained(ASSET), _config("float32"))
    if rank == 1:
        sample = engine.engine.sampler

        def fail_at_step_3(*args, **kwargs):
            if engine.steps == 3:
                raise RuntimeError("sampler failed (injected)")
            return sample(*args, **kwargs)
        engine.engine.sampler = fail_at_step_3
    engine.generate(_requests(rank, "uneven"))


def test_a_peer_failing_between_steps_stops_the_others_at_once_naming_it():
    r0, r1 = run_world(_failing_rank, 2, guard_s=60)
    assert r1.error_type == "RuntimeError" and "sampler failed (injected)" in r1.error, r1.error
    assert r0.error_type == "DistributedError", r0.error
    first = r0.error.splitlines()[0]
    # told at the next step's agreement: not a timeout ("timed out after 30s"), nor a hang
    assert first.startswith("rank 0: all_reduce MAX of forward calls (expert-parallel engine step 4): rank 1 "
                            "failed"), first


def _windowed_rank(rank: int, dtype: str) -> dict:
    """One EP engine read from the checkpoint with this rank's experts only, one from the full model."""
    from lockstep.dist.engine_expert_parallel import expert_parallel_engine, expert_parallel_engine_from_pretrained
    from lockstep.dist.groups import init_distributed
    from lockstep.models import load_pretrained
    from lockstep.models.tokenizer import load_tokenizer

    ctx = init_distributed(20.0)
    out = {}
    for how in ("windowed", "full"):  # the full one with the tokenizer from_pretrained loads (its EOS stops)
        engine = expert_parallel_engine_from_pretrained(ctx, ASSET, _config(dtype), ep_size=2) if how == "windowed" \
            else expert_parallel_engine(ctx, load_pretrained(ASSET, dtype=getattr(torch, dtype)), _config(dtype),
                                        load_tokenizer(ASSET))
        out[how] = _digest(engine.generate(_requests(rank, "uneven")))
        out[f"{how}_state"] = {n: t.clone() for n, t in engine.model.state_dict().items()}
    return out


@DTYPES
def test_an_ep_engine_read_with_its_experts_only_serves_what_the_full_load_serves(dtype):
    torch.set_num_threads(1)
    ranks = rank_values(run_world(_windowed_rank, 2, guard_s=60, args=(dtype,)))
    one = _one_engine(dtype).model.state_dict()
    for rank, got in enumerate(ranks):
        _assert_same(got["windowed"], got["full"], f"{dtype} rank {rank}: windowed load")
        assert set(got["windowed_state"]) == set(got["full_state"]) == set(one)
        for name, t in got["windowed_state"].items():
            assert torch.equal(t, got["full_state"][name]), f"rank {rank}: {name}"
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # its block of the served experts
                assert torch.equal(t, one[name][rank * 4:(rank + 1) * 4]), f"rank {rank}: {name}"


def test_experts_that_do_not_split_over_the_ep_ranks_are_refused_naming_the_fields():
    from lockstep.dist.expert_parallel import expert_window

    assert expert_window(8, 2, 1) == range(4, 8)
    with pytest.raises(ValueError, match=r"n_routed_experts 8 \(config.json\) does not split over "
                                         r"rollout_expert_parallel_size 3"):
        expert_window(8, 3, 0, "rollout_expert_parallel_size")
    with pytest.raises(ValueError, match=r"does not split over expert_model_parallel_size 3"):
        expert_window(8, 3, 0)


def test_the_ep_engine_refuses_true_on_policy_naming_why():
    from lockstep.dist.engine_expert_parallel import _serving_config

    with pytest.raises(ValueError, match="rollout_expert_parallel_size > 1 with true_on_policy"):
        _serving_config(EngineConfig(true_on_policy=True))
    assert _serving_config(EngineConfig()).true_on_policy is False  # left to the default: off here


def _wrong_window_rank(rank: int) -> None:
    from lockstep.dist.engine_expert_parallel import expert_parallel_engine
    from lockstep.dist.groups import init_distributed
    from lockstep.models import load_pretrained

    ctx = init_distributed(20.0)
    other = range(4, 8) if rank == 0 else range(0, 4)  # the peer's experts
    expert_parallel_engine(ctx, load_pretrained(ASSET, experts=other), _config("float32"))


def test_a_rank_handed_another_ranks_experts_is_refused_naming_both_windows():
    for rank, r in enumerate(run_world(_wrong_window_rank, 2, guard_s=60)):
        assert r.error_type == "ValueError", r.error
        mine, held = ("[0, 4)", "[4, 8)") if rank == 0 else ("[4, 8)", "[0, 4)")
        assert f"gate_up_proj holds experts {held}, but rank {rank} of 2 serves {mine} of 8" in r.error, r.error
