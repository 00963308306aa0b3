"""A weight update's value checks, made on the device (engine/weight_update.py validates with them).

Every floating tensor's finiteness (tensor_finite_triton.py's kernel on CUDA, else torch's norms, one
launch per dtype group) and every hash table's expert ids (in [0, n_routed_experts)), launched
without waiting, read later in one host read (`DeviceChecks.confirm`). Each failure also closes a
gate on the device (`new_gate`), which a write gated on it reads, so that the write can be launched
before the checks are read and still write nothing where one failed. What the checks read per layout
is kept (`ValuePlan`), and what they read per update once (`Sources`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lockstep import tensor_finite_triton
from lockstep.engine.update_errors import WeightUpdateError


def launch_expert_extremes(pairs: list[tuple[str, torch.Tensor]], n_experts: int | None,
                           tables: list[int] | None = None, gate: torch.Tensor | None = None) -> tuple[list, list]:
    """Start the range check of every hash table (tid2eid; `tables`: their positions in pairs, where a
    ValuePlan knows them) without waiting for it: (the tables' names, [their (min, max) pairs as one
    tensor on the device]); `read_device_checks` reads it. An id out of range closes `gate`."""
    tables = [pairs[i] for i in (tables if tables is not None else ValuePlan.hash_tables(pairs))]
    if n_experts is None or not tables:
        return [], []
    device = tables[0][1].device
    # (min, max) of each table in turn: a launch a table and one stack (four a table were host time)
    extremes = torch.stack([v.to(device, torch.long) for _, t in tables for v in torch.aminmax(t)])
    if gate is not None:
        gate.add_(((extremes[0::2] < 0) | (extremes[1::2] >= n_experts)).any().to(gate.device))
    return [name for name, _ in tables], [extremes]


def check_expert_ids(names: list[str], extremes: list[int], n_experts: int | None) -> None:
    """Every hash table holds expert ids in [0, n_experts), from launch_expert_extremes' values."""
    for name, lo, hi in zip(names, map(int, extremes[0::2]), map(int, extremes[1::2])):
        if lo < 0 or hi >= n_experts:
            raise WeightUpdateError(f"{name}: expert ids must be in [0, {n_experts}), got [{lo}, {hi}]")


def read_device_checks(parts: list[torch.Tensor]) -> list[list]:
    """Each of `parts` (small 1-D tensors: finiteness flags, the tables' extremes) as a list, in one
    host read per device (a read per check was a wait on the device each; float64 holds each value
    exactly: flags, and expert ids far below 2**53)."""
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, t in enumerate(parts):
        by_device[t.device].append(i)
    out: list[list] = [[] for _ in parts]
    for positions in by_device.values():
        values = torch.cat([parts[i].to(torch.float64) for i in positions]).tolist()
        for i in positions:
            out[i], values = values[:parts[i].numel()], values[parts[i].numel():]
    return out


class Sources(NamedTuple):
    """An update's tensors' addresses and whether every one is contiguous, read once per update for
    the kernels' kept launches (their keys: tensor_tables.call_key's `addresses`) and their
    conditions: a pass over gpu-848m's 242 tensors per kernel was host time the device waited on."""

    addresses: tuple
    contiguous: bool

    @classmethod
    def of(cls, pairs: list[tuple[str, torch.Tensor]]) -> "Sources":
        return cls(tuple([t.data_ptr() for _, t in pairs]), all(t.is_contiguous() for _, t in pairs))


def all_contiguous(tensors: list[torch.Tensor], sources: Sources | None) -> bool:
    """Every tensor contiguous: known where the whole update's are (`sources`), else checked."""
    return (sources is not None and sources.contiguous) or all(t.is_contiguous() for t in tensors)


@dataclass(frozen=True)
class ValuePlan:
    """What validate_update's value checks read in one layout of an update (`layout_key`), by position:
    the floating tensors in order (`floats`) and by (device, dtype) group (`groups`: one launch or
    multi-tensor call each), and the hash tables (`tables`). Kept per layout in the UpdateTargets
    once its name / shape / dtype checks passed: sorting 242 tensors by dtype each update was host
    time the device waited on."""

    floats: list[int]
    groups: list[list[int]]
    tables: list[int]

    @classmethod
    def of(cls, pairs: list[tuple[str, torch.Tensor]]) -> "ValuePlan":
        floats = [i for i, (_, t) in enumerate(pairs)
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
        for i in floats:
            groups[pairs[i][1].device, pairs[i][1].dtype].append(i)
        return cls(floats, list(groups.values()), cls.hash_tables(pairs))

    @staticmethod
    def hash_tables(pairs: list[tuple[str, torch.Tensor]]) -> list[int]:
        return [i for i, (name, t) in enumerate(pairs)
                if name.endswith("tid2eid") and isinstance(t, torch.Tensor) and t.numel()]


def launch_finiteness(pairs: list[tuple[str, torch.Tensor]], plan: ValuePlan | None = None,
                      layout: tuple | None = None, gate: torch.Tensor | None = None,
                      sources: Sources | None = None) -> tuple[list, list]:
    """Start the finiteness check of every floating tensor of `pairs` without waiting for it: (the
    floating pairs, [(a group's pairs, whether each one is finite, on the device)]). One launch per
    (device, dtype) group (`plan`'s, where the caller keeps one for `layout`): torch's multi-tensor
    norm takes one dtype, a mixed list fell back to a kernel per tensor (240 launches, 5.6 ms of
    validation on gpu-848m). A value that may not be finite closes `gate`. `sources`: the pairs'
    addresses and contiguity, where the caller read them (with `layout`)."""
    plan = plan or ValuePlan.of(pairs)
    launched = []
    for g, positions in enumerate(plan.groups):
        items = [pairs[i] for i in positions]
        launched.append((items, _finite([t for _, t in items], None if layout is None else (layout, g), gate,
                                        sources if layout is not None else None)))
    return [pairs[i] for i in plan.floats], launched


INTERPRETED_KERNELS = False  # the update's copy / finiteness kernels under TRITON_INTERPRET=1 too (a test's)


def kernels_run(t: torch.Tensor) -> bool:
    """The update's kernels act on CUDA tensors; on the CPU under the interpreter only where a test
    asks (INTERPRETED_KERNELS): every update of the suite through them doubled tests/engine's time."""
    return t.is_cuda or INTERPRETED_KERNELS


def _finite(tensors: list[torch.Tensor], layout=None, gate: torch.Tensor | None = None,
            sources: Sources | None = None) -> torch.Tensor:
    """bool [len(tensors)] on the device, whether each tensor's values are all finite (one dtype):
    with tensor_finite_triton.FINITE_KERNEL on (the default), that kernel's exact flags; else (or
    where it cannot read them) isfinite of their 2-norms. `layout`: a key fixing the tensors' dtypes
    and shapes (ValuePlan's), so that only their contiguity is checked each call. `gate` is closed
    where a flag is raised, or a norm is not finite (which finite values above ~1e19 can make:
    DeviceChecks.confirm tells). `sources` (with `layout`): the whole update's, read once."""
    tf = tensor_finite_triton
    if tf.FINITE_KERNEL and kernels_run(tensors[0]) and (
            tf.checkable(tensors) if layout is None
            else tf.checkable(tensors[:1]) and all_contiguous(tensors, sources)):
        return tf.nonfinite_flags(tensors, layout, gate, sources.addresses if sources is not None else None) == 0
    finite = torch.isfinite(torch.stack(torch._foreach_norm(tensors)))
    if gate is not None:
        gate.add_((~finite).any().to(gate.device))
    return finite


def first_nonfinite(floats: list, launched: list, flags: list[list] | None = None) -> tuple[str, int] | None:
    """The first tensor of `floats` holding NaN or inf, and how many, from launch_finiteness's flags
    (`flags`: them already read, read_device_checks; else one host read per group: a count and a host
    read per tensor were 25 ms of a 36 ms update of an 853M model on an H200). The exact count runs
    only where a norm is not finite, since a norm can overflow where no value is bad."""
    flags = flags if flags is not None else read_device_checks([finite for _, finite in launched])
    suspects = set()
    for (items, _), ok_flags in zip(launched, flags):
        suspects.update(name for (name, _), ok in zip(items, ok_flags) if not ok)
    for name, t in floats:
        if name in suspects:
            bad = (~torch.isfinite(t)).sum().item()
            if bad:
                return name, bad
    return None


@dataclass
class DeviceChecks:
    """An update's value checks launched on the device and not yet read (validate_update's
    `confirm=False`): the finiteness flags (launch_finiteness), the hash tables' extremes and,
    where every check can close it, `gate` (int32 [1] on the update's device: 0 while every check
    passes). A write gated on it (write_served's `gate`) runs before the read and writes nothing
    where a check failed, so the host's work on the write overlaps the checks' kernels instead of
    waiting for their flags (gpu-848m's bf16 update: the read between them was ~0.4 ms of host
    preparation the device waited on)."""

    finiteness: tuple
    tables: list[str]
    extremes: list[torch.Tensor]
    n_experts: int | None
    gate: torch.Tensor | None

    def confirm(self) -> bool:
        """Read the checks; raise WeightUpdateError naming the first failure. An open gate says every
        check passed (each failure closes it), so where there is one it is read alone, the rest only
        where it is closed. Returns whether the gate was closed though every check passed (a norm
        overflowing on finite values, where the norms stand in for the kernel): a gated write then
        wrote nothing."""
        if self.gate is not None and not self.gate.item():  # one small read, the update's only wait
            return False
        parts = [finite for _, finite in self.finiteness[1]] + self.extremes
        flags = read_device_checks(parts)
        check_expert_ids(self.tables, flags.pop() if self.extremes else [], self.n_experts)
        nonfinite = first_nonfinite(*self.finiteness, flags)
        if nonfinite is not None:
            raise WeightUpdateError(f"{nonfinite[0]}: {nonfinite[1]} non-finite values (NaN or inf)")
        return self.gate is not None


def new_gate(pairs: list[tuple[str, torch.Tensor]], plan: ValuePlan) -> torch.Tensor | None:
    """A fresh open gate (DeviceChecks) where every floating tensor is on one device the update's
    kernels run on (a write gated on it is a kernel's), else None."""
    if not plan.floats:
        return None
    device = pairs[plan.floats[0]][1].device
    if any(pairs[group[0]][1].device != device for group in plan.groups) or not kernels_run(pairs[plan.floats[0]][1]):
        return None
    return torch.zeros(1, dtype=torch.int32, device=device)
