"""Expert-parallel trainer, 2 gloo processes, the bundled tiny DeepSeek-V4 in fp32 (DISTRIBUTED.md proof (b)).

EP=2: each rank keeps 4 of the 8 routed experts of every MoE layer (one hash-routed layer, three
top-k layers) and trains on half of the samples (one micro-batch each); tokens travel to their
experts' rank and back by all-to-all. EP=1: one process (today's Trainer) on all the samples,
packed into the same two micro-batches. Logprobs, loss and every metric, the gradients (expert
shards gathered, replicated gradients summed over ranks) and the weights after each of two AdamW
steps must be bitwise equal (torch.equal); the same with rollout routing replay (also with one rank's
prompts a single token: no prompt routing to compute there, yet it must run the forward its peers
run), in bf16 and with the fp8-fp4 quantisation-aware forward. A rank
whose experts get no rows joins the backward exchange; a 2-rank EP checkpoint resumes exactly and
loads into one process.

With LOCKSTEP_TEST_DEVICE=cuda on 2 GPUs the same EP=2 vs EP=1 checks run over NCCL (one rank a GPU,
all-to-alls on NCCL; EP=1 on one GPU) for the routed, routing-replay and bf16 scenarios, each
reported (bitwise or the largest difference) before it is asserted (dist_world.world_devices).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lockstep
from dist_world import (cpu_world_only, device_scenarios, max_abs_diff, rank_values, report, run_world,
                        to_cpu)
from lockstep.models import load_pretrained
from lockstep.train.data_parallel import DataParallel, gather_full
from lockstep.train.quant_aware import canonical_name
from lockstep.train.trainer import Trainer
from read_spy import experts_read, spy_on_reads
from test_fsdp import EVEN, _assert_same, _budget, _config, _run
from tests.train.trainer_fixtures import make_samples

ASSET = Path(lockstep.__file__).parent / "assets" / "tiny-dsv4"
N_LAYERS, TOP_K, N_EXPERTS = 4, 2, 8


def _samples(name: str):
    # vocab 103 is the tiny model's; replay: random rollout experts for every response token and layer
    shape = (N_LAYERS, TOP_K) if SCENARIOS[name][0] else None
    samples = make_samples(4, seed=3, vocab=103, prompt_len=(3, 7), response_len=(3, 8), routing_shape=shape,
                           n_experts=N_EXPERTS)
    if name == "replay-one-token-prompts":  # rank 0 has no prompt position to route before the responses
        samples[:2] = make_samples(2, seed=4, vocab=103, prompt_len=(1, 1), response_len=(3, 8),
                                   routing_shape=shape, n_experts=N_EXPERTS)
    return samples


# name: (routing replay, dtype, quantisation-aware forward: fp8 linears, fp4 experts)
SCENARIOS = {"routed": (False, "float32", None), "routing-replay": (True, "float32", None),
             "replay-one-token-prompts": (True, "float32", None), "bf16": (False, "bfloat16", None),
             "qat-fp8-fp4": (False, "float32", "fp8-fp4")}


def _config_for(name: str, ep: int):
    replay, dtype, qat = SCENARIOS[name]
    return _config(dtype, _budget(_samples(name), EVEN)).replace(
        use_rollout_routing_replay=replay, expert_model_parallel_size=ep, quant_aware_forward=qat)


def _trace(trainer: Trainer, samples) -> dict:
    """Logprobs before training, then two steps (test_fsdp's `_run`: gradients, metrics, weights)."""
    logprobs = trainer.logprobs(samples)
    return {"logprobs": logprobs, **_run(trainer, samples)}


def _ep_trainer(ctx, name: str) -> Trainer:
    """What the loop builds from TrainConfig.expert_model_parallel_size and the DistContext: each rank
    reads only its block of the experts (load_expert_parallel)."""
    from lockstep.dist.expert_parallel import load_expert_parallel

    config = _config_for(name, 2)
    model = load_expert_parallel(ASSET, config.expert_model_parallel_size, ctx, torch.float32)
    return Trainer(model, config, data_parallel=DataParallel(ctx.trainer_group, device=ctx.device,
                                                             collective=ctx.collective))


# on the GPUs: EP=2 vs EP=1 in fp32, with routing replay and in bf16 (issue 18); the other scenarios,
# the empty-rank exchange and the checkpoint are covered by the CPU run
CUDA_SCENARIOS = ("routed", "routing-replay", "bf16")


def _ep_rank(rank: int, checkpoint: str | None) -> dict:
    from lockstep.dist.expert_parallel import ExpertParallelExperts
    from lockstep.dist.groups import init_distributed

    ctx = init_distributed(30.0)
    out, reads = {}, []
    spy_on_reads(reads)  # this process ends with the test
    for name in SCENARIOS if ctx.device.type == "cpu" else CUDA_SCENARIOS:
        reads.clear()
        trainer = _ep_trainer(ctx, name)
        out.setdefault("experts_read", experts_read(reads))
        local = [m.expert_weights()[0].shape[0] for m in trainer.model.modules()
                 if isinstance(m, ExpertParallelExperts)]
        out[name] = {"local_experts": local, **_trace(trainer, _samples(name)[2 * rank:2 * rank + 2])}
    if checkpoint is not None:
        out["no-rows"] = _no_rows_on_rank0(ctx, rank)
        out["resume"] = _resume(ctx, _samples("routed")[2 * rank:2 * rank + 2], checkpoint)
    return out


def _resume(ctx, mine, directory: str) -> dict:
    """Step, save, step (unbroken); a fresh EP trainer loads the save and steps again."""
    unbroken = _ep_trainer(ctx, "routed")
    unbroken.train_step(mine)
    unbroken.save(directory)
    out = {"unbroken": unbroken.train_step(mine), "unbroken_weights": dict(unbroken.named_weights())}
    resumed = _ep_trainer(ctx, "routed")
    resumed.load(directory)
    out.update(resumed=resumed.train_step(mine), resumed_weights=dict(resumed.named_weights()))
    return out


def _no_rows_on_rank0(ctx, rank: int) -> dict:
    """One MoE layer's experts, every token of both ranks routed to rank 1's experts (4..7): rank 0
    computes nothing, yet must join both all-to-alls of the backward (else rank 1 waits forever)."""
    from lockstep.dist.expert_parallel import ExpertParallelExperts, ep_mesh

    experts = load_pretrained(ASSET).model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 64, generator=g, requires_grad=True)
    chosen, weights = torch.tensor([[4, 5], [5, 7], [4, 6], [6, 7], [4, 7]]), torch.rand(5, TOP_K, generator=g)
    want = experts(x, chosen, weights)  # one process, this rank's tokens
    want.sum().backward()
    want_x_grad, want_grad = x.grad, experts.gate_up_proj.grad
    x.grad = None
    ep = ExpertParallelExperts(experts, ep_mesh(ctx.trainer_group, "cpu"), ctx.collective)
    got = ep(x, chosen, weights)
    got.sum().backward()
    return {"out": torch.equal(got, want), "x_grad": torch.equal(x.grad, want_x_grad), "want_grad": want_grad,
            "local_grad": ep.gate_up_proj.grad.to_local(), "full_grad": gather_full(ep.gate_up_proj.grad)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ep-checkpoint")


@pytest.fixture(scope="module")
def two_ranks(device, checkpoint) -> list[dict]:
    """Every scenario on one 2-process world (starting processes costs more than the steps)."""
    cpu = device == "cpu"
    return rank_values(run_world(_ep_rank, 2, guard_s=120 if cpu else 240, args=(str(checkpoint) if cpu else None,),
                                   device=device))


def _expert_halves_used(grads: dict) -> None:
    """Every MoE layer's experts on both ranks had tokens: the dispatch really crossed ranks."""
    grads = {canonical_name(n): g for n, g in grads.items()}  # a QAT parameter's name has .parametrizations.
    for layer in range(N_LAYERS):
        g = grads[f"model.layers.{layer}.mlp.experts.down_proj"]
        per_expert = g.abs().flatten(1).sum(1)
        assert per_expert[:N_EXPERTS // 2].sum() > 0 and per_expert[N_EXPERTS // 2:].sum() > 0, layer


@pytest.mark.parametrize("device,name", device_scenarios(SCENARIOS, CUDA_SCENARIOS), scope="module")
def test_ep2_equals_ep1(two_ranks, device, name):
    samples = _samples(name)
    reference = to_cpu(_trace(Trainer(load_pretrained(ASSET, device=device), _config_for(name, 1)), samples))
    assert reference["metrics"][0]["train/grad_norm"] > 1e-5  # clipping binds: the EP norm is used
    _expert_halves_used(reference["grads"])
    for rank, result in enumerate(two_ranks):
        got = result[name]
        assert got["local_experts"] == [N_EXPERTS // 2] * N_LAYERS
        pairs = list(zip(got["logprobs"], reference["logprobs"][2 * rank:2 * rank + 2]))
        if device != "cpu":
            report(check=f"ep2 vs ep1 {name}, rank {rank}: logprobs before training ({device})",
                   logprobs_max_abs_diff=max(max_abs_diff(g, w) for g, w in pairs))
        for i, (g, w) in enumerate(pairs):
            assert torch.equal(g, w), f"rank {rank} sample {i}: logprobs"
        _assert_same(got, reference, f"ep2 vs ep1 {name}, rank {rank}", device)


@cpu_world_only
def test_each_rank_reads_only_its_experts(two_ranks, device):
    """The EP trainer's load reads from the checkpoint only this rank's block of every layer's routed
    experts (load_expert_parallel): no rank holds all of them, on the host either."""
    for rank, result in enumerate(two_ranks):
        half = N_EXPERTS // 2
        assert result["experts_read"] == set(range(rank * half, (rank + 1) * half)), rank


@cpu_world_only
def test_rank_without_rows_joins_the_exchange(two_ranks, device):
    r0, r1 = (r["no-rows"] for r in two_ranks)
    assert r0["out"] and r1["out"] and r0["x_grad"] and r1["x_grad"]
    assert torch.equal(r0["local_grad"], torch.zeros_like(r0["local_grad"]))  # a zero gradient, not None
    want = r0["want_grad"] + r1["want_grad"]  # one process accumulating the two ranks' tokens
    assert want[N_EXPERTS // 2:].abs().sum() > 0
    assert torch.equal(r0["full_grad"], want) and torch.equal(r1["full_grad"], want)


@cpu_world_only
def test_resume_from_two_ranks(two_ranks, checkpoint, device):
    """The EP save (experts gathered into the one-process files) resumes 2 EP ranks exactly, and one
    process (today's Trainer) that loads it takes the same next step on all the samples."""
    for rank, result in enumerate(two_ranks):
        r = result["resume"]
        assert r["resumed"] == r["unbroken"], rank
        for name, w in r["unbroken_weights"].items():
            assert torch.equal(r["resumed_weights"][name], w), (rank, name)
    one = Trainer(load_pretrained(ASSET), _config_for("routed", 1))
    one.load(checkpoint)
    unbroken = two_ranks[0]["resume"]
    assert one.train_step(_samples("routed")) == unbroken["unbroken"]
    for name, w in one.named_weights():
        assert torch.equal(w, unbroken["unbroken_weights"][name]), name


def test_trainer_refuses_unsharded_experts():
    with pytest.raises(ValueError, match="shard the experts first"):
        Trainer(load_pretrained(ASSET), _config_for("routed", 2))
    with pytest.raises(ValueError, match="expert_model_parallel_size"):
        _config_for("routed", 2).replace(compile_backend="eager")
