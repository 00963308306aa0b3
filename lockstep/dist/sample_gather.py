"""Rollout samples gathered to every rank as flat tensors, with only their small fields pickled.

`gather_samples(local, group, collective, what)` returns every rank's list of samples, in rank
order, field for field what `all_gather_object(local)` returned, in three steps on `group`:

1. `all_gather_object` of each rank's small part: per sample its non-tensor fields (reward, finish
   reason, group id, weight version, metadata, advantages) and the shape of each tensor field;
   per rank the dtype of each field. The shapes give every rank every other rank's sizes.
2. per tensor field (prompt ids, response ids, rollout logprobs, loss mask, routed experts), each
   rank's values of all its samples concatenated into one flat tensor, padded to the longest
   rank's, and `all_gather`ed: one collective per field that any rank has, of raw values, so the
   result is bitwise what was sent (no cast, no pickling).
3. the flat tensors cut back into each sample's tensors: views, one flat buffer per rank and field.

Pickling a rollout costs a serialisation and a copy on the sender, an unpickling on every receiver
and a padded byte gather of the pickles; a large one (routed experts: R x layers x top-k int32 per
sample) spends most of its gather there (benchmarks/sample_gather.py: old vs new time). The tensors
travel on the CPU over `group` (the gloo control group: idle ranks wait there through a rollout
without an NCCL watchdog; the engine builds its samples on the CPU), and come back on the CPU.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from lockstep.sample import Sample

# the Sample fields that travel as flat tensors; every other attribute is pickled with the small part
TENSOR_FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "routed_experts")


class _Flat(NamedTuple):
    """Stands in the small part for a tensor that travels flat: its field's next `shape` elements."""

    shape: tuple[int, ...]


def _small_part(local: list[Sample]) -> dict:
    """What step 1 sends for this rank: each sample's attributes in their order, its tensor fields
    replaced by their shapes; the dtype of each tensor field."""
    samples, dtypes = [], {}
    for s in local:
        attrs = {}
        for name, value in vars(s).items():
            if name in TENSOR_FIELDS and isinstance(value, torch.Tensor):
                attrs[name] = _Flat(tuple(value.shape))
                if dtypes.setdefault(name, value.dtype) != value.dtype:  # one flat tensor holds them all
                    raise ValueError(f"gather_samples: this rank's samples hold {name} in {dtypes[name]} and "
                                     f"{value.dtype}")
            else:
                attrs[name] = value
        samples.append(attrs)
    return {"samples": samples, "dtypes": dtypes}


def _numel(part: dict, name: str) -> int:
    return sum(math.prod(a[name].shape) for a in part["samples"] if isinstance(a.get(name), _Flat))


def _field_dtype(parts: list[dict], name: str) -> torch.dtype | None:
    """The dtype every rank that has field `name` sends it in (None: no rank has it)."""
    seen = {r: p["dtypes"][name] for r, p in enumerate(parts) if name in p["dtypes"]}
    if len(set(seen.values())) > 1:
        raise ValueError(f"gather_samples: ranks send {name} in different dtypes: {seen}")
    return next(iter(seen.values()), None)


def _flat(local: list[Sample], name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """This rank's `name` of every sample, concatenated and zero-padded to `numel` elements."""
    pieces = [getattr(s, name).reshape(-1).cpu() for s in local if isinstance(getattr(s, name), torch.Tensor)]
    out = torch.zeros(numel, dtype=dtype)
    if pieces:
        torch.cat(pieces, out=out[:sum(p.numel() for p in pieces)])
    return out


def _gather_field(local: list[Sample], parts: list[dict], name: str, group, collective, what: str) -> list:
    """Every rank's flat `name` tensor, unpadded (step 2); no collective when no rank has the field."""
    dtype, sizes = _field_dtype(parts, name), [_numel(p, name) for p in parts]
    if dtype is None or max(sizes) == 0:
        return [torch.empty(0)] * len(parts)
    out = [torch.empty(max(sizes), dtype=dtype) for _ in parts]
    with collective(f"all_gather of {what}: {name}"):
        dist.all_gather(out, _flat(local, name, dtype, max(sizes)), group=group)
    return [t[:n] for t, n in zip(out, sizes)]


def _rebuild(part: dict, flats: dict[str, torch.Tensor]) -> list[Sample]:
    """One rank's samples from its small part and its flat tensors (step 3), as unpickling builds
    them: the attributes as sent, in their order, no __post_init__ (they passed it where they were made)."""
    offsets = dict.fromkeys(flats, 0)
    samples = []
    for attrs in part["samples"]:
        sample = Sample.__new__(Sample)
        for name, value in attrs.items():
            if isinstance(value, _Flat):
                n = math.prod(value.shape)
                value = flats[name][offsets[name]:offsets[name] + n].view(value.shape)
                offsets[name] += n
            setattr(sample, name, value)
        samples.append(sample)
    return samples


def gather_samples(local: list[Sample], group, collective: Callable, what: str) -> list[list[Sample]]:
    """Every rank's samples in rank order (module docstring); `collective(op)` names each step's
    failure (DistContext.collective), `what` the gather in those names."""
    parts: list = [None] * dist.get_world_size(group)
    with collective(f"all_gather_object of {what}"):
        dist.all_gather_object(parts, _small_part(local), group=group)
    by_field = {name: _gather_field(local, parts, name, group, collective, what) for name in TENSOR_FIELDS}
    return [_rebuild(part, {name: flats[r] for name, flats in by_field.items()}) for r, part in enumerate(parts)]
