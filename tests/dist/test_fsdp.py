"""FSDP2 trainer, 2 gloo processes, the bundled tiny DeepSeek-V4 (DISTRIBUTED.md proof (a)).

Each rank trains on half of the samples (one micro-batch each); one process (today's Trainer, no
FSDP) trains on all of them, packed into the same two micro-batches. Loss and every metric,
the gathered gradients and the parameters after each of two AdamW steps must be bitwise equal
(torch.equal). In bf16 the single process accumulates micro-batch gradients in bf16 and FSDP in
fp32 (reduce_dtype), so the reference there is FSDP on one rank, whose forward (loss and logprob
metrics) is checked against today's bf16 Trainer.
"""

from __future__ import annotations

from pathlib import Path

import torch

import lockstep
from dist_world import run_world
from lockstep.models import load_pretrained
from lockstep.train.config import TrainConfig
from lockstep.train.data_parallel import DataParallel
from lockstep.train.trainer import Trainer
from tests.train.trainer_fixtures import make_samples

ASSET = Path(lockstep.__file__).parent / "assets" / "tiny-dsv4"
STEPS = 2


def _samples(n: int = 4):
    # vocab 103 is the tiny model's; lengths vary, so the halves differ in size
    return make_samples(n, seed=3, vocab=103, prompt_len=(3, 7), response_len=(3, 8))


def _budget(samples) -> int:
    """max_tokens_per_gpu that packs the first and second half as one micro-batch each."""
    half = len(samples) // 2
    first, second = (sum(s.num_tokens for s in part) for part in (samples[:half], samples[half:]))
    budget = max(first, second)
    assert first + samples[half].num_tokens > budget  # the single process starts a new micro-batch there
    return budget


def _config(dtype: str, budget: int) -> TrainConfig:
    # a large lr and a clip that binds make both steps move every parameter visibly
    return TrainConfig(lr=1e-2, clip_grad=1e-3, max_tokens_per_gpu=budget, dtype=dtype, use_tis=True,
                       weight_decay=0.01)


def _run(trainer: Trainer, samples) -> dict:
    """STEPS train steps; the full gradients at the first step, the full weights after each."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def recording_step(*args):
        if not grads:
            for name, p in trainer.model.named_parameters():
                g = p.grad  # None for the indexer (its top-k is not differentiable), on every rank
                grads[name] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g).float().clone()
        return step(*args)

    trainer.optimizer.step = recording_step
    out = {"metrics": [], "weights": [], "grads": grads}
    for _ in range(STEPS):
        out["metrics"].append(trainer.train_step(samples))
        out["weights"].append({n: t.clone() for n, t in trainer.named_weights()})
    return out


def _fsdp_rank(rank: int, dtype: str, world_size: int) -> dict:
    from lockstep.dist.fsdp import apply_fsdp, dp_mesh
    from lockstep.dist.groups import init_distributed

    ctx = init_distributed(30.0)
    samples = _samples()
    per_rank = len(samples) // world_size
    model = apply_fsdp(load_pretrained(ASSET), dp_mesh(ctx.trainer_group, "cpu"),
                       param_dtype=getattr(torch, dtype))
    trainer = Trainer(model, _config(dtype, _budget(samples)), data_parallel=DataParallel(ctx.trainer_group))
    return _run(trainer, samples[rank * per_rank:(rank + 1) * per_rank])


def _assert_same(got: dict, want: dict, what: str) -> None:
    for i, (g, w) in enumerate(zip(got["metrics"], want["metrics"])):
        assert g.keys() == w.keys(), what
        diff = {k: (g[k], w[k]) for k in w if g[k] != w[k]}
        assert not diff, f"{what} step {i}: metrics differ {diff}"
    assert got["grads"].keys() == want["grads"].keys()
    assert sum(g is not None for g in want["grads"].values()) > 50
    for name, w in want["grads"].items():
        same = got["grads"][name] is None if w is None else torch.equal(got["grads"][name], w)
        assert same, f"{what}: gradient of {name}"
    for i, (g, w) in enumerate(zip(got["weights"], want["weights"])):
        assert list(g) == list(w), f"{what}: named_weights order"
        for name in w:
            assert g[name].dtype == w[name].dtype and torch.equal(g[name], w[name]), f"{what} step {i}: {name}"


def _world(dtype: str, world_size: int) -> list[dict]:
    results = run_world(_fsdp_rank, world_size, guard_s=120, args=(dtype, world_size))
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.value for r in results]


def test_two_ranks_equal_one_process_fp32():
    samples = _samples()
    reference = _run(Trainer(load_pretrained(ASSET), _config("float32", _budget(samples))), samples)
    assert reference["metrics"][0]["train/num_microbatches"] == 2.0
    assert reference["metrics"][0]["train/grad_norm"] > 1e-3  # clipping binds
    r0, r1 = _world("float32", 2)
    _assert_same(r0, reference, "rank 0")
    _assert_same(r1, reference, "rank 1")
    moved = [n for n, w in reference["weights"][-1].items() if w.is_floating_point()
             and not torch.equal(w, load_pretrained(ASSET).state_dict()[n])]
    assert len(moved) > 50  # the steps changed the weights that are compared


def test_two_ranks_equal_one_rank_bf16():
    (one,) = _world("bfloat16", 1)
    r0, r1 = _world("bfloat16", 2)
    _assert_same(r0, one, "rank 0")
    _assert_same(r1, one, "rank 1")
    # FSDP on one rank and today's bf16 Trainer compute the same forward: the first step's loss terms
    # and logprob metrics agree bit for bit (its gradient then differs: today's sums micro-batch
    # gradients in bf16, FSDP in fp32)
    samples = _samples()
    today = Trainer(load_pretrained(ASSET), _config("bfloat16", _budget(samples))).train_step(samples)
    forward = [k for k in today if k not in ("train/grad_norm",)]
    assert {k: one["metrics"][0][k] for k in forward} == {k: today[k] for k in forward}
    assert one["metrics"][0]["train/grad_norm"] != today["train/grad_norm"]
