"""Pushing new weights into a serving model: validate everything, then quantise and write in place.

`update_weights(model, named_tensors, fmt)` takes (name, tensor) pairs with the trainer's names,
which are the model's state-dict names (parameters AND persistent buffers: `tid2eid` and
`e_score_correction_bias` define the policy too, see Miles PR 2706). An update holds every tensor
of the model (a tensor tied to a sent one, e.g. a tied LM head, counts as sent), unless the caller
says `partial=True` (a bucketed sync sends several): a checkpoint holding 1 of 272 tensors was
accepted and the model then emitted garbage. Before anything is written, every tensor is checked:

    missing names (unless partial), unknown name, duplicated name, wrong shape, float where an
    integer table is expected (or the reverse), hash-routing ids outside [0, n_routed_experts),
    then, over all tensors at once, non-finite values

and the first problem raises `WeightUpdateError` naming the tensor; the model is untouched and
keeps serving the previous version. What passed is a `ValidatedUpdate`, which update_weights
writes without checking again (a bucketed push validates each bucket as it stages it, then joins
them: weight_push.py). Then each tensor is replaced by its served value
(`serving_format.served_value`: dequant(quant(w)) in the destination's dtype) and copied in
place: the unquantised ones together (on CUDA a byte copy of the same-dtype ones,
tensor_copy_triton.py, and one multi-tensor copy of those that cast), the others one at a time, so
the peak extra memory is one tensor's served value. Quantisation cannot fail halfway: the shapes
equal the model's, which were quantised when the engine was built. A weight held packed
(packed_weights.py: fp8 bytes + block scales) is quantised straight into its storage instead. On
CUDA the finiteness check is tensor_finite_triton.py's kernel, and where the byte copy is the whole
write (a bf16 engine's), that write is launched before the checks are read, gated on them on the
device (DeviceChecks): a failed check closes the gate and the copy writes nothing. What depends
only on an update's layout (names, dtypes, shapes: the checks, which tensor goes where) is decided
once per layout and kept in the engine's UpdateTargets: a push sends one layout every step, and
per-tensor host work before the launches is time the device waits on. An update repeating the last
ones' tensors (the same addresses) may replay their captured device work (update_replay.py, REPLAY).

What depends on the weights (the rollout caches) is the engine's to flush afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from lockstep import tensor_copy_triton, tensor_finite_triton
from lockstep.engine import update_replay, value_checks
from lockstep.engine.update_errors import WeightUpdateError, WeightVersionError
from lockstep.engine.update_replay import UpdateReplays, replay_key
from lockstep.engine.value_checks import (DeviceChecks, Sources, ValuePlan, all_contiguous, kernels_run,
                                          launch_expert_extremes, launch_finiteness, new_gate)
from lockstep.models.layers.fp8_linear import gatable, packed_weights, quantise_packed
from lockstep.quant.serving_format import copied_unchanged, served_value


def check_version(current: int, version: int, partial: bool) -> None:
    """Versions only increase: a sample's weight_version must name one set of weights. The buckets
    of one partial (bucketed) update may share the version they build up to."""
    if version < current or (version == current and not partial):
        raise WeightVersionError(f"version {version} does not come after the version serving now, {current}; "
                                 f"weight versions only increase")


def serving_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> the model's tensor (parameters and persistent buffers; tied names share storage)."""
    return dict(model.state_dict())


def _pairs(named_tensors) -> list[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, Mapping):
        return list(named_tensors.items())
    return list(named_tensors)


def _check_one(name: str, t, dest: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise WeightUpdateError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(dest.shape):
        raise WeightUpdateError(f"{name}: shape {tuple(t.shape)} does not match the model's {tuple(dest.shape)}")
    if dest.is_floating_point():
        if not t.is_floating_point():
            raise WeightUpdateError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        return
    if t.is_floating_point() or t.is_complex():
        raise WeightUpdateError(f"{name}: expected an integer tensor like the model's {dest.dtype}, got {t.dtype}")


def storage_keys(dest: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """name -> what a tied tensor shares with the one it is tied to (address and shape)."""
    return {n: (t.data_ptr(), tuple(t.shape)) for n, t in dest.items()}


def missing_tensors(keys: dict[str, tuple], sent: set[str]) -> list[str]:
    """The model's tensors (`storage_keys`) an update leaves out; one sharing storage with a sent
    tensor (tied) is covered."""
    covered = {keys[n] for n in sent}
    return [n for n, k in keys.items() if n not in sent and k not in covered]


@dataclass(frozen=True)
class UpdateTargets:
    """What an update of `model` is checked against and written into: its tensors by name (`dest`),
    the tensor each sent one must match (`expected`: a packed weight's unpacked shape), its packed
    weights (`packed`, quantised into in place), its expert count and its ties (`keys`). An engine
    builds them once and keeps them (Engine.update_targets); elsewhere once per update (a bucketed
    push: once for all its buckets): the state_dict and packed-weights walks are ~1 ms of host time
    on an 8-layer model (gpu-848m, 242 tensors: 0.9 ms on this project's CPU machine)."""

    dest: dict[str, torch.Tensor]
    expected: dict[str, torch.Tensor]
    packed: dict
    n_experts: int | None
    keys: dict[str, tuple]  # storage_keys(dest): ties, for the missing-tensor check
    plans: dict = field(default_factory=dict)  # write_served's WritePlan per layout of an update
    checked: dict = field(default_factory=dict)  # (layout_key, partial) -> ValuePlan, once its name / shape /
    # dtype checks passed
    layouts: dict = field(default_factory=dict)  # each Layout seen, kept (layout_key)
    replays: UpdateReplays = field(default_factory=UpdateReplays)  # repeated updates' device work (REPLAY)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "UpdateTargets":
        dest = serving_tensors(model)
        packed = packed_weights(model)
        # a packed tensor is checked against its unpacked shape (packed_weights.py)
        expected = dict(dest, **{n: p.logical for n, p in packed.items()})
        return cls(dest, expected, packed, getattr(getattr(model, "config", None), "n_routed_experts", None),
                   storage_keys(dest))


class ValidatedUpdate(list):
    """(name, tensor) pairs that passed validate_update's checks against `model` (made only by
    validate_update, `joined` and update_weights' own validation): update_weights writes them without
    checking them again, which would read every value a second time (a bucketed push validates each
    bucket as it stages it).
    Its tensors are not copied: whoever holds one must not change them before it is written. Made
    with `confirm=False`, `checks` holds its value checks still on the device: update_weights
    writes it gated on them, then reads them (DeviceChecks)."""

    def __init__(self, pairs, model: torch.nn.Module, targets: UpdateTargets, partial: bool, layout: tuple,
                 checks: DeviceChecks | None = None, sources: Sources | None = None):
        super().__init__(pairs)
        self.model, self.targets, self.partial, self.layout = model, targets, partial, layout
        self.checks, self.sources = checks, sources

    @classmethod
    def joined(cls, parts: "list[ValidatedUpdate]", partial: bool) -> "ValidatedUpdate":
        """Parts of one update validated apart (each partial, against the same targets): the names
        are checked across them (sent twice; missing, unless partial); their values were checked."""
        if not parts or any(part.model is not parts[0].model or part.targets is not parts[0].targets
                            or part.checks is not None for part in parts):
            raise ValueError("ValidatedUpdate.joined takes one or more parts validated (and confirmed) against the "
                             "same targets")
        pairs = [pair for part in parts for pair in part]
        _check_names(parts[0].model, parts[0].targets, [name for name, _ in pairs], partial)
        sources = None if any(part.sources is None for part in parts) else Sources(
            sum((part.sources.addresses for part in parts), ()), all(part.sources.contiguous for part in parts))
        return cls(pairs, parts[0].model, parts[0].targets, partial, Layout(sum((part.layout for part in parts), ())),
                   sources=sources)


def _check_names(model: torch.nn.Module, targets: UpdateTargets, names: list[str], partial: bool) -> None:
    """Every name the model's, none twice, and (unless partial) none of the model's missing."""
    seen: set[str] = set()
    for name in names:
        if name not in targets.dest:
            raise WeightUpdateError(f"{name}: unknown tensor name (not a parameter or persistent buffer of "
                                    f"{type(model).__name__})")
        if name in seen:
            raise WeightUpdateError(f"{name}: sent twice in one update")
        seen.add(name)
    missing = [] if partial else missing_tensors(targets.keys, seen)
    if missing:
        raise WeightUpdateError(f"{missing[0]}: missing from the update ({len(missing)} of the model's "
                                f"{len(targets.dest)} tensors are); send them all, or mark the update partial")


MAX_PLANS = 64  # layouts an UpdateTargets keeps checks and WritePlans for (a push's buckets: one each)


class Layout(tuple):
    """layout_key's value: its hash computed once, since one update's layout keys several tables
    (its checks, its WritePlan, the kernels' prepared launches); a table hit on the kept object
    compares by identity (hashing 242 tensors' entries was ~12 us a lookup, this project's CPU)."""

    _hash = None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = tuple.__hash__(self)
        return self._hash


def layout_key(pairs: list[tuple[str, torch.Tensor]], targets: "UpdateTargets | None" = None) -> Layout:
    """All the name, shape and dtype checks of an update depend on (and write_served's WritePlan); the
    targets' kept Layout object where they have seen it."""
    try:
        key = Layout([(name, t.dtype, t.device, t.shape) for name, t in pairs])
    except AttributeError:  # not a tensor: _check_one names it
        key = Layout((name, type(t)) for name, t in pairs)
    if targets is None:
        return key
    if len(targets.layouts) >= MAX_PLANS:
        targets.layouts.clear()
    return targets.layouts.setdefault(key, key)


def validate_update(model: torch.nn.Module, named_tensors, partial: bool = False,
                    targets: UpdateTargets | None = None, confirm: bool = True) -> ValidatedUpdate:
    """All checks of the module docstring, for every tensor, before anything is written. `targets`:
    `UpdateTargets.of(model)` when the caller checks several parts of one update. The checks of
    names, shapes and dtypes are made once per layout and kept in the targets (a push sends the
    same layout every time: 0.45 ms of host time an update of gpu-848m's 242 tensors, this project's
    CPU machine); the values' checks (finiteness, expert ids) run on the device, read in one wait,
    unless `confirm` is False: then they are left on the device in the update's `checks`
    (DeviceChecks; update_weights' gated write)."""
    update, plan = _checked(model, named_tensors, partial, targets)
    checks = launch_value_checks(update, plan, gated=not confirm)
    if confirm:
        checks.confirm()
    else:
        update.checks = checks
    return update


def _checked(model: torch.nn.Module, named_tensors, partial: bool,
             targets: UpdateTargets | None) -> tuple[ValidatedUpdate, ValuePlan]:
    """The update with its name, shape and dtype checks passed (kept per layout) and its sources read;
    its values not checked yet (launch_value_checks), and the layout's ValuePlan."""
    pairs = _pairs(named_tensors)
    targets = targets or UpdateTargets.of(model)
    layout = layout_key(pairs, targets)
    plan = targets.checked.get((layout, partial))
    if plan is None:
        _check_names(model, targets, [name for name, _ in pairs], partial)
        for name, t in pairs:
            _check_one(name, t, targets.expected[name])
        if len(targets.checked) >= MAX_PLANS:
            targets.checked.clear()
        plan = targets.checked[layout, partial] = ValuePlan.of(pairs)
    return ValidatedUpdate(pairs, model, targets, partial, layout, sources=Sources.of(pairs)), plan


def launch_value_checks(update: ValidatedUpdate, plan: ValuePlan, gated: bool) -> DeviceChecks:
    """The update's value checks launched on the device, not read; `gated`: closing a fresh gate."""
    gate = new_gate(update, plan) if gated else None
    finiteness = launch_finiteness(update, plan, update.layout, gate, update.sources)
    tables, extremes = launch_expert_extremes(update, update.targets.n_experts, plan.tables, gate)
    return DeviceChecks(finiteness, tables, extremes, update.targets.n_experts, gate)


@dataclass(frozen=True)
class WritePlan:
    """How write_served writes one layout of an update (`layout_key`: names, dtypes, devices, shapes), by
    position: the unquantised tensors' destinations, those the byte copy may take (`kernel`:
    tensor_copy_triton.copyable_but_source_strides; the sources' contiguity is checked each write) apart from
    those that cast (`copy`: one multi-tensor copy), the packed weights' storage per format (fp8 /
    fp4: one quantisation call each) and the rest (an emulated quantised value), one at a time.
    Made once per layout and kept in the UpdateTargets: the decisions per tensor were ~0.27 ms of
    host time per update of gpu-848m's 242 tensors (this project's CPU machine)."""

    kernel: list[int]
    kernel_dests: list[torch.Tensor]
    kernel_dests_key: tuple  # their addresses, read once (the engine's weights never move): copy_many's key
    copy: list[int]
    copy_dests: list[torch.Tensor]
    packed: dict[str, tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]]  # format -> (positions, storage)
    other: list[int]

    @classmethod
    def of(cls, targets: "UpdateTargets", pairs: list[tuple[str, torch.Tensor]], fmt: str) -> "WritePlan":
        kernel, copy, packed, other = [], [], {}, []
        for i, (name, t) in enumerate(pairs):
            d = targets.dest[name]
            if name in targets.packed:
                kind, storage = targets.packed[name].packed_target()
                positions, storages = packed.setdefault(kind, ([], []))
                positions.append(i)
                storages.append(storage)
            elif copied_unchanged(name, t, fmt, d.dtype) and t.device == d.device:
                (kernel if tensor_copy_triton.copyable_but_source_strides(d, t) else copy).append(i)
            else:
                other.append(i)
        dests = lambda positions: [targets.dest[pairs[i][0]] for i in positions]  # noqa: E731
        return cls(kernel, dests(kernel), tuple(d.data_ptr() for d in dests(kernel)), copy, dests(copy), packed,
                   other)


@torch.no_grad()
def write_served(model: torch.nn.Module, pairs: Iterable[tuple[str, torch.Tensor]], fmt: str,
                 targets: UpdateTargets | None = None, gate: torch.Tensor | None = None) -> bool:
    """Every tensor stored unquantised is copied in one multi-tensor copy (a copy casts exactly as
    served_value's `.to` does); a copy per tensor was ~240 launches, ~5 ms of gpu-848m's update.
    Likewise every packed weight (packed_weights.py: quantised straight into its storage) is
    quantised in one call per storage format (on CUDA one launch per dtype group, where a launch
    per weight cost ~60 us of host time each). Which tensor goes where is a WritePlan, kept per
    layout. With `gate` (DeviceChecks'), the write is made only where all of it can be gated (every
    tensor by the byte copy or a packed weight's kernel: a bf16 engine's update, a packed fp8 one's)
    and writes nothing if the gate is closed when it runs; returns whether it was made (without a
    gate: True)."""
    targets = targets or UpdateTargets.of(model)
    if isinstance(pairs, ValidatedUpdate):
        key = (fmt, pairs.layout)
    else:
        pairs = list(pairs)
        key = (fmt, layout_key(pairs, targets))
    plan = targets.plans.get(key)
    if plan is None:
        if len(targets.plans) >= MAX_PLANS:  # e.g. many partial updates of different tensors
            targets.plans.clear()
        plan = targets.plans[key] = WritePlan.of(targets, pairs, fmt)
    sources = pairs.sources if isinstance(pairs, ValidatedUpdate) else None
    if gate is not None:
        return _gated_write(plan, pairs, key, gate, sources)
    _copy(plan, pairs, key, sources)
    for kind, (positions, storages) in plan.packed.items():
        quantise_packed(kind, [pairs[i][1].to(storages[0][0].device) for i in positions], storages, (key, kind))
    for i in plan.other:
        name, t = pairs[i]
        d = targets.dest[name]
        d.copy_(served_value(name, t.to(d.device), fmt, d.dtype))
    return True


def _copy(plan: WritePlan, pairs: list, key: tuple, sources: Sources | None = None) -> None:
    """Every unquantised tensor of the plan copied: those the byte copy may take in one Triton launch
    per alignment (tensor_copy_triton.WRITE_KERNEL, on CUDA, where every source is contiguous), the
    rest by one multi-tensor copy (which casts)."""
    dests, srcs = plan.copy_dests, [pairs[i][1] for i in plan.copy]
    by_kernel = [pairs[i][1] for i in plan.kernel]
    if by_kernel and _byte_copy_takes(plan, by_kernel, sources):
        tensor_copy_triton.copy_many(plan.kernel_dests, by_kernel, layout=key, addresses=_addresses(plan, sources))
    else:
        dests, srcs = dests + plan.kernel_dests, srcs + by_kernel
    if dests:
        torch._foreach_copy_(dests, srcs)


def _byte_copy_takes(plan: WritePlan, tensors: list[torch.Tensor], sources: Sources | None) -> bool:
    """The plan's byte-copy tensors go by tensor_copy_triton's kernel: on, running here, every source
    contiguous (the plan fixes the rest)."""
    return (tensor_copy_triton.WRITE_KERNEL and kernels_run(plan.kernel_dests[0])
            and all_contiguous(tensors, sources))


def _addresses(plan: WritePlan, sources: Sources | None) -> tuple | None:
    """copy_many's `addresses` key for the plan's byte copy: the update's sources', the plan's
    destinations'."""
    return None if sources is None else (sources.addresses, plan.kernel_dests_key)


def _gated_write(plan: WritePlan, pairs: list, key: tuple, gate: torch.Tensor, sources: Sources | None) -> bool:
    """The whole write gated on `gate` where every part of the plan can be (the byte copy; the packed
    weights' kernels, their sources and storage on the gate's device): whether it was made."""
    by_kernel = [pairs[i][1] for i in plan.kernel]
    packed = {kind: [pairs[i][1] for i in positions] for kind, (positions, _) in plan.packed.items()}
    if (plan.copy or plan.other or not (by_kernel or packed)
            or by_kernel and not (plan.kernel_dests[0].device == gate.device
                                  and _byte_copy_takes(plan, by_kernel, sources))
            or not all(storages[0][0].device == gate.device and all(w.device == gate.device for w in packed[kind])
                       and gatable(kind, packed[kind]) for kind, (_, storages) in plan.packed.items())):
        return False
    if by_kernel:
        tensor_copy_triton.copy_many(plan.kernel_dests, by_kernel, layout=key, gate=gate,
                                     addresses=_addresses(plan, sources))
    for kind, (_, storages) in plan.packed.items():
        quantise_packed(kind, packed[kind], storages, (key, kind), gate)
    return True


GATED_WRITE = True  # update_weights writes gated on the checks where it can (DeviceChecks), before reading them


def _write_gated(update: ValidatedUpdate, checks: DeviceChecks, fmt: str) -> bool:
    """write_served gated on `checks` where they have a gate and the whole write can be: whether it was made."""
    return GATED_WRITE and checks.gate is not None and write_served(update.model, update, fmt, update.targets,
                                                                     gate=checks.gate)


def _launch_switches() -> tuple:
    """The module flags that choose an update's launches (part of its replay key)."""
    return (GATED_WRITE, tensor_copy_triton.WRITE_KERNEL, tensor_finite_triton.FINITE_KERNEL,
            value_checks.INTERPRETED_KERNELS)


def update_weights(model: torch.nn.Module, named_tensors, fmt: str, partial: bool = False,
                   targets: UpdateTargets | None = None) -> int:
    """Validate all, then write all; returns the number of tensors written. A ValidatedUpdate of this
    model (validated as a whole update, or partial where this one is) is not checked again.
    `targets`: the model's UpdateTargets, where the caller keeps them (Engine.update_targets).
    Where the whole write can be gated on the value checks (DeviceChecks), it is launched before
    they are read, and a failed check leaves it writing nothing; else the checks are read first."""
    pairs = named_tensors
    if isinstance(pairs, ValidatedUpdate) and pairs.model is model and (partial or not pairs.partial):
        checks = pairs.checks
        written = checks is not None and _write_gated(pairs, checks, fmt)
    else:
        pairs, plan = _checked(model, named_tensors, partial, targets)

        def launch(update=pairs):  # the update's device work, replayed where it repeats (update_replay.py)
            checks = launch_value_checks(update, plan, gated=True)
            return checks, _write_gated(update, checks, fmt)

        if update_replay.REPLAY:
            key = replay_key(fmt, pairs.layout, partial, pairs.sources, _launch_switches())
            checks, written = pairs.targets.replays.run(key, launch)
        else:
            checks, written = launch()
    if checks is not None:
        closed = checks.confirm()  # raises where a check failed: nothing was written
        pairs.checks = None
        written = written and not closed  # closed by a norm's overflow on finite values: nothing written
    if not written:
        write_served(model, pairs, fmt, pairs.targets)
    return len(pairs)


def apply_serving_format(model: torch.nn.Module, fmt: str) -> None:
    """Replace every weight of the model by its served value (done once when an engine is built;
    packed weights were quantised when packed)."""
    packed = packed_weights(model)
    write_served(model, [(n, t) for n, t in serving_tensors(model).items() if n not in packed], fmt)


def load_update_from_disk(path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint directory's tensors under the model's names (dequantised to float32 when stored
    quantised; the engine re-quantises them to its own serving format)."""
    from lockstep.models import load_state_dict

    return load_state_dict(path, model.config, dtype=torch.float32)
