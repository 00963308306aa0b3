"""Where an in-process weight update spends its time: each part alone, against the copy bound.

The colocated RL loop's `perf/weight_sync_time` is `Engine.update_weights(trainer.named_weights())`:
the trainer's weights walked (models/live_state.py), validated (names and shapes once per layout,
then every value's finiteness and the hash tables' expert ids read on the device), then written
(engine/weight_update.py: one multi-tensor copy of the unquantised weights, the packed ones
re-quantised). Issue 17's bar: within 2x of the pushed bytes copied at the device's copy bandwidth.
This prints, for the model's weights (bf16 serving by default), each part's best time over --repeats and its
ratio to that bound, measured in the same run (one flat copy of the same bytes):

    python benchmarks/weight_update_parts.py --config gpu-848m        # on a GPU
    python benchmarks/weight_update_parts.py --config gpu-848m --serving-format fp8 --packed
    python benchmarks/weight_update_parts.py --config cpu-tiny

Parts: the walk; the finiteness check as the update makes it (tensor_finite_triton.py's kernel on
CUDA) alone and with its host read, and by torch's norms (`_foreach_norm` per dtype group);
validate_update, and the same with its checks left on the device (the gated update's); the same
bytes copied by `_foreach_copy_`, tensor by tensor and by tensor_copy_triton.py's byte copy (where
Triton runs), beside one flat copy (the bound: what a flat weight buffer would cost); the update's
write; the whole update with the walk, the same with both kernels off, with its checks read
before the write is launched (no gate: value_checks.DeviceChecks), and with its device work launched
each update (update_replay.REPLAY off; on, the default, it is replayed from a CUDA graph from the
third update on). On a GPU the device time of
each part (CUDA events) is printed beside its wall time: a wall time far above the device time is
host work the device waits on. The parts without a host read are also replayed from a CUDA graph
("graphed": their kernels alone, the host's preparation gone), as is the flat copy.
"""

from __future__ import annotations

import argparse
import time

import torch

from grpo_step import _configs, make_model

from lockstep.config import EngineConfig
from lockstep.engine import Engine
from lockstep.engine import update_replay
from lockstep.engine import value_checks as vc
from lockstep.engine import weight_update as wu
from lockstep.models.live_state import LiveState
from lockstep.models.precision import cast_model
from lockstep import tensor_copy_triton, tensor_finite_triton
from lockstep.tensor_copy_triton import copyable, copy_many
from lockstep.tensor_finite_triton import checkable, nonfinite_flags


def timed(fn, device: torch.device, repeats: int) -> tuple[float, float | None]:
    """(best wall s, best device s by CUDA events or None on CPU) of fn() over `repeats` calls after one."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    wall, dev = float("inf"), float("inf")
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync()
        t = time.perf_counter()
        if cuda:
            start.record()
        fn()
        if cuda:
            end.record()
        sync()
        wall = min(wall, time.perf_counter() - t)
        if cuda:
            dev = min(dev, start.elapsed_time(end) / 1e3)
    return wall, (dev if cuda else None)


def graphed(fn, repeats: int) -> float | None:
    """Best device s of fn replayed from a CUDA graph over `repeats` replays: its kernels alone, the
    host's preparation gone; None where fn cannot be captured (a host read, a pageable copy)."""
    fn()  # warm: the kernels' launches prepared and kept (tensor_tables.PreparedLaunches)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        print(f"  (not captured: {str(e).splitlines()[0][:100]})", flush=True)
        torch.cuda.synchronize()
        return None
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


# the parts whose kernels are timed replayed from a CUDA graph too (no host read in them)
GRAPHED = ("finiteness, launched", "finiteness kernel alone", "write: ", "write_served")


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cpu-tiny", choices=sorted(_configs()))
    p.add_argument("--serving-format", default="bf16", choices=("bf16", "fp8", "fp8-fp4"))
    p.add_argument("--packed", action="store_true", help="the engine's fp8 linears and experts packed: the write "
                                                         "re-quantises into the packed storage")
    p.add_argument("--repeats", type=int, default=10)
    return p.parse_args()


def switched(fn, *settings: tuple):
    """fn with each (module, flag, value) of `settings` set for the call, restored after (a row's A/B)."""
    def run():
        saved = [getattr(module, flag) for module, flag, _ in settings]
        for module, flag, value in settings:
            setattr(module, flag, value)
        try:
            return fn()
        finally:
            for (module, flag, _), value in zip(settings, saved):
                setattr(module, flag, value)
    return run


def without_kernels(fn):
    """fn with tensor_copy_triton.WRITE_KERNEL and tensor_finite_triton.FINITE_KERNEL off (the update's
    torch form against its kernels, same run)."""
    return switched(fn, (tensor_copy_triton, "WRITE_KERNEL", False), (tensor_finite_triton, "FINITE_KERNEL", False))


def ungated(fn):
    """fn with weight_update.GATED_WRITE off: the update's checks read before its write is launched."""
    return switched(fn, (wu, "GATED_WRITE", False))


def launched(fn):
    """fn with update_replay.REPLAY off: a repeated update's device work launched anew, not replayed."""
    return switched(fn, (update_replay, "REPLAY", False))


def _finiteness_rows(pairs) -> dict:
    """The check as the update makes it, and by tensor_finite_triton's kernel where Triton runs."""
    groups = [g for g in ([pairs[i][1] for i in positions] for positions in vc.ValuePlan.of(pairs).groups)
              if checkable(g)]
    rows = {"finiteness, launched": lambda: vc.launch_finiteness(pairs),
            "finiteness + host read": lambda: vc.first_nonfinite(*vc.launch_finiteness(pairs)),
            "finiteness by torch's norms + host read": without_kernels(
                lambda: vc.first_nonfinite(*vc.launch_finiteness(pairs)))}
    if groups:
        rows[f"finiteness kernel alone ({sum(map(len, groups))} tensors)"] = lambda: [
            nonfinite_flags(g) for g in groups]
    return rows


def _copy_rows(pairs, targets) -> dict:
    """The bf16 write's copies three ways: the update's multi-tensor copy, tensor by tensor, and by
    tensor_copy_triton's kernel where Triton runs."""
    dests, sources = [targets.dest[name] for name, _ in pairs], [t for _, t in pairs]
    by_kernel = [(d, s) for d, s in zip(dests, sources) if copyable(d, s)]
    rows = {"write: _foreach_copy_": lambda: torch._foreach_copy_(dests, sources),
            "write: copy_ per tensor": lambda: [d.copy_(s) for d, s in zip(dests, sources)]}
    if by_kernel:
        rows[f"write: Triton byte copy ({len(by_kernel)} of {len(pairs)} tensors)"] = lambda: copy_many(
            [d for d, _ in by_kernel], [s for _, s in by_kernel])
    return rows


def main() -> None:
    args = _args()
    bench = _configs()[args.config]
    device = torch.device(bench.device if bench.device != "cuda" or torch.cuda.is_available() else "cpu")
    source = cast_model(make_model(bench), torch.bfloat16).to(device)
    engine = Engine(make_model(bench), EngineConfig(
        max_num_seqs=4, max_model_len=64, max_prefill_tokens=64, device=str(device), dtype="bfloat16",
        serving_format=args.serving_format, packed_fp8=args.packed, packed_experts=args.packed, cuda_graph=False,
        true_on_policy=False))
    live, targets = LiveState.of(source), engine.update_targets()
    pairs = list(live.items(detached=True))
    nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    wall, dev = timed(lambda: flat_dst.copy_(flat_src), device, args.repeats)
    bound = dev if dev is not None else wall
    print(f"{args.config} {args.serving_format}{' packed' if args.packed else ''} on {device}: {len(pairs)} tensors, "
          f"{nbytes / 1e6:.1f} MB; copy bound {bound * 1e3:.3f} ms ({nbytes / bound / 1e9:.0f} GB/s, one flat copy "
          f"of the same bytes)", flush=True)
    validated = wu.validate_update(engine.model, pairs, targets=targets)
    versions = iter(range(1, 10 ** 9))
    parts = {
        "walk (LiveState)": lambda: list(live.items(detached=True)),
        "walk (state_dict)": lambda: list(source.state_dict().items()),
        **_finiteness_rows(pairs),
        "validate_update": lambda: wu.validate_update(engine.model, pairs, targets=targets),
        "validate_update, its checks launched, not read": lambda: wu.validate_update(
            engine.model, pairs, targets=targets, confirm=False),
        **(_copy_rows(pairs, targets) if args.serving_format == "bf16" else {}),
        "write_served (the update's write)": lambda: wu.write_served(engine.model, validated, args.serving_format,
                                                                     targets),
        "Engine.update_weights with the walk": lambda: engine.update_weights(
            live.items(detached=True), version=next(versions)),
    }
    if tensor_copy_triton.triton is not None:
        parts["the same, torch's copy and norms (kernels off)"] = without_kernels(
            parts["Engine.update_weights with the walk"])
        parts["the same, checks read before the write (no gate)"] = ungated(
            parts["Engine.update_weights with the walk"])
        parts["the same, launched each update (REPLAY off)"] = launched(
            parts["Engine.update_weights with the walk"])
    if device.type == "cuda":
        flat = graphed(lambda: flat_dst.copy_(flat_src), args.repeats)
        print(f"flat copy from a CUDA graph {flat * 1e3:.3f} ms", flush=True)
    for label, fn in parts.items():
        wall, dev = timed(fn, device, args.repeats)
        on_device = f", device {dev * 1e3:8.3f} ms ({dev / bound:5.2f} of the bound)" if dev is not None else ""
        kernels = (graphed(fn, args.repeats) if device.type == "cuda" and label.startswith(GRAPHED)
                   and not (args.packed and label.startswith("write_served")) else None)
        if kernels is not None:
            on_device += f", graphed {kernels * 1e3:8.3f} ms ({kernels / bound:5.2f})"
        print(f"{label:50s} wall {wall * 1e3:8.3f} ms ({wall / bound:5.2f} of the bound){on_device}", flush=True)


if __name__ == "__main__":
    main()
