"""benchmarks/fsdp_step.py's prototypes (benchmark-only): each patches objects of this rank's trainer
inside the benchmark process and changes nothing in lockstep. See fsdp_step.py's docstring for what
each variant does and which keep the one-process numbers."""

from __future__ import annotations

import contextlib
import functools

import torch

VARIANTS = ("coalesce-grads", "no-reshard", "unit-gather", "bf16-gather")
MEASURE_ONLY = ("bf16-reduce",)  # changes the numbers the step computes


def _coalesced_sum_grads(dp):
    """DataParallel.sum_grads as one all_reduce over the flattened gradients (same sums, one call)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    @torch.no_grad()
    def sum_grads(params) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if not dp.enabled or not grads:
            return
        for dtype in sorted({g.dtype for g in grads}, key=str):  # a flat buffer per dtype
            same = [g for g in grads if g.dtype == dtype]
            flat = dp.sum(_flatten_dense_tensors(same), "replicated gradients (coalesced)")
            for g, s in zip(same, _unflatten_dense_tensors(flat, same)):
                g.copy_(s)
    return sum_grads


def _unit_gather_weights(trainer):
    """Trainer.named_weights with one all-gather per FSDP unit (FSDPModule.unshard: every parameter of
    the unit in one collective, already cast to the unit's compute dtype) instead of one full_tensor
    per parameter."""
    from torch.distributed.tensor import DTensor

    from lockstep.dist.fsdp import fsdp_modules
    from lockstep.train.quant_aware import canonical_name

    def gathered() -> dict[str, torch.Tensor]:
        out = {}
        for m in fsdp_modules(trainer.model):
            sharded = {n for n, p in trainer.model.named_parameters() if isinstance(p, DTensor)}
            m.unshard()
            for n, p in trainer.model.named_parameters():  # the unit's parameters are plain tensors now
                if n in sharded and not isinstance(p, DTensor):
                    out[canonical_name(n)] = p.detach().clone()
            m.reshard()
        return out

    def named_weights():
        full = gathered()
        for name, t in trainer._live_tensors():
            yield name, full[name] if name in full else t.detach()
    return named_weights


def _check_weights(trainer, fn, variant: str) -> None:
    same = all(na == nb and torch.equal(a, b) and a.dtype == b.dtype
               for (na, a), (nb, b) in zip(trainer.named_weights(), fn()))
    if not same:
        raise AssertionError(f"{variant}: the weights differ from Trainer.named_weights")


def _bf16_gather_weights(trainer):
    """Trainer.named_weights with each shard cast to its compute dtype before the gather."""
    from torch.distributed.tensor import DTensor

    from lockstep.models.precision import storage_dtype
    from lockstep.train.data_parallel import full_tensor

    def named_weights():
        for name, t in trainer._live_tensors():
            if not isinstance(t, DTensor):
                yield name, t.detach()
                continue
            local = t.to_local()
            if trainer.config.dtype == "bfloat16" and local.is_floating_point():
                local = local.to(storage_dtype(trainer.model, name, torch.bfloat16))
            yield name, full_tensor(local, t).detach()
    return named_weights


def apply_variant(trainer, variant: str, samples):
    """Patch this rank's trainer for `variant`; returns the weight-gather function to time."""
    from lockstep.dist.fsdp import fsdp_modules

    # all: the bitwise-safe ones together (unit-gather wins over bf16-gather, which it includes)
    chosen = set(VARIANTS) - {"bf16-gather"} if variant == "all" else {variant} - {"base", *MEASURE_ONLY}
    if "coalesce-grads" in chosen:
        trainer.dp.sum_grads = _coalesced_sum_grads(trainer.dp)
    if "no-reshard" in chosen:
        for m in fsdp_modules(trainer.model):
            m.set_reshard_after_forward(False, recurse=False)
    for name, make in (("unit-gather", _unit_gather_weights), ("bf16-gather", _bf16_gather_weights)):
        if name in chosen:
            fn = make(trainer)
            _check_weights(trainer, fn, name)
            return fn
    return trainer.named_weights


# ---- one rank -----------------------------------------------------------------------------------


@contextlib.contextmanager
def reduce_dtype(dtype: torch.dtype):
    """apply_fsdp with this reduce_dtype while _sharded_trainer runs (it imports the function on call)."""
    import lockstep.dist.fsdp as fsdp

    original = fsdp.apply_fsdp
    fsdp.apply_fsdp = functools.partial(original, reduce_dtype=dtype)
    try:
        yield
    finally:
        fsdp.apply_fsdp = original
