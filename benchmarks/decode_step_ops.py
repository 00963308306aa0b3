"""Per decode step: how many kernels the engine would launch and how often it would stall on the host.

    python benchmarks/decode_step_ops.py --config 1b --batch 64                   # CPU, a few minutes
    python benchmarks/decode_step_ops.py --config tiny --batch 8 --temperature 0.8

Runs the engine on the CPU (no GPU needed), prefills --batch prompts, then records --steps
decode steps with torch.profiler and counts, per step:
- kernel launches: aten ops that run a kernel on a GPU (views, allocations and composite
  wrappers such as aten::linear -> aten::mm are not counted twice; aten::_grouped_mm counts
  once, and the host reads of its CPU fallback are not counted as syncs). With CUDA graphs the forward's ops
  are replayed as ONE graph launch: `--graph` runs the decode forward through the graph
  runner's eager stand-in (same static shapes, padding and fixed capacity) to count them;
- device->host syncs: reads of a tensor's values from Python (`.tolist()`, `.item()`,
  `int(t)`, `.cpu()`), ops whose output size depends on the data (`nonzero`, boolean-mask
  indexing, `unique`, `masked_select`, `bincount`), and blocking host->device copies of
  Python-built tensors (`torch.tensor(..., device=d)`, `.to(d)` without non_blocking: CUDA
  synchronises the stream before a copy from pageable memory);
- async host->device copies (pinned, non_blocking): no stall, listed for completeness.
On a GPU every sync drains the launch queue; these counts are what the decode step pays.
"""

from __future__ import annotations

import argparse
import collections
import sys
import weakref
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import build_model  # noqa: E402

from lockstep.config import EngineConfig, SamplingParams  # noqa: E402
from lockstep.engine import Engine, GenerateRequest  # noqa: E402

# no kernel of their own: views, allocations, metadata
NO_KERNEL = {"empty", "empty_like", "empty_strided", "view", "_unsafe_view", "as_strided", "as_strided_", "t",
             "transpose", "permute", "expand", "unsqueeze", "squeeze", "select", "slice", "narrow", "split",
             "split_with_sizes", "unbind", "detach", "detach_", "alias", "lift_fresh", "resize_", "_reshape_alias",
             "diagonal", "unfold", "result_type", "resolve_conj", "resolve_neg", "item", "_local_scalar_dense",
             "nonzero_numpy", "chunk", "view_as", "expand_as", "lift_fresh_copy", "pin_memory", "_pin_memory",
             "is_pinned", "record_stream"}
# only their children run kernels
COMPOSITE = {"linear", "matmul", "einsum", "to", "_to_copy", "reshape", "contiguous", "flatten", "unflatten",
             "softmax", "log_softmax", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros",
             "new_full", "new_ones", "new_empty", "argsort", "type_as", "stack", "embedding", "__and__", "__or__",
             "square", "mean", "arange", "index_put_", "clone", "masked_fill", "cat"}
# CPU-only implementations that read values on the host; the CUDA kernel does not
CPU_FALLBACK = {"_grouped_mm"}
# output size depends on the values (or reads them): the host waits for the device
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
            "unique_dim", "bincount", "repeat_interleave"}
HOST_READS = {"tolist", "cpu", "numpy"}  # item / int() / float() show up as aten::_local_scalar_dense


class HostTraffic(TorchFunctionMode):
    """Counts Python-level transfers: reads of tensor values and copies of host-built tensors."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self._host_born: dict[int, weakref.ref] = {}  # id -> tensor built from Python data on the host

    def _mark(self, t) -> None:
        self._host_born[id(t)] = weakref.ref(t)

    def _is_host_born(self, t) -> bool:
        ref = self._host_born.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        if name in HOST_READS:
            self.counts["d2h_read"] += 1
        elif name in ("tensor", "as_tensor") and not isinstance(args[0], torch.Tensor):
            if kwargs.get("device") is not None:
                self.counts["h2d_blocking"] += 1
            else:
                self._mark(out)
        elif name == "pin_memory" and self._is_host_born(args[0]):
            self._mark(out)
        elif name in ("to", "cuda") and isinstance(args[0], torch.Tensor) and self._is_host_born(args[0]):
            if _moves_device(args[1:], kwargs):
                self.counts["h2d_async" if kwargs.get("non_blocking") else "h2d_blocking"] += 1
        elif name == "copy_" and len(args) > 1 and self._is_host_born(args[1]):
            self.counts["h2d_async" if kwargs.get("non_blocking") or (len(args) > 2 and args[2]) else "h2d_blocking"] += 1
        return out


def _moves_device(args, kwargs) -> bool:
    first = args[0] if args else kwargs.get("device")
    return isinstance(first, (str, torch.device)) or (isinstance(first, torch.Tensor)) or "device" in kwargs


def count_profile(events) -> dict[str, collections.Counter]:
    """Per phase (the lockstep:: range around an op): kernel launches and sync ops.

    A launch is the outermost aten op that is neither a view nor a composite wrapper: what it
    calls on the CPU (wrapped Python scalars converted by aten::to, sum's fill_) is not counted."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    parent = {id(c): e for e in events for c in e.cpu_children}
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        op, anc, phase, under_launch, under_cpu_fallback = e.name[6:], parent.get(id(e)), "host", False, False
        while anc is not None:
            if anc.name.startswith("aten::"):
                up = anc.name[6:]
                under_launch |= up not in NO_KERNEL and up not in COMPOSITE
                under_cpu_fallback |= up in CPU_FALLBACK
            elif anc.name.startswith("lockstep::") and phase == "host":
                phase = anc.name[10:]
            anc = parent.get(id(anc))
        if op in SYNC_OPS and not under_cpu_fallback:
            out[phase]["sync_ops"] += 1
        if op not in NO_KERNEL and op not in COMPOSITE and not under_launch:
            out[phase]["launches"] += 1
    return out


def phased(fn, name):
    def wrapped(*a, **k):
        with record_function(f"lockstep::{name}"):
            return fn(*a, **k)
    return wrapped


def instrument(engine: Engine, graph: bool) -> None:
    if graph:
        enable_graph_stand_in(engine)
    engine.runner.execute = phased(engine.runner.execute, "forward")
    sampler = engine.sampler
    engine.sampler = phased(sampler, "sample")


def enable_graph_stand_in(engine: Engine) -> None:
    from lockstep.engine.cuda_graph import DecodeGraphs

    engine.runner.graphs = DecodeGraphs(engine.adapter, engine.config.max_num_seqs, capture=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=["tiny", "1b"], default="1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the throughput benchmark's setting)")
    ap.add_argument("--routing", action="store_true", help="requests return routed experts (RL rollouts do)")
    ap.add_argument("--graph", action="store_true", help="decode through the CUDA-graph runner's eager stand-in")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.device = "cpu"
    model = build_model(args)
    engine = Engine(model, EngineConfig(max_num_seqs=args.batch, max_model_len=args.prompt_len + args.steps + 8,
                                        max_prefill_tokens=args.batch * args.prompt_len))
    instrument(engine, args.graph)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    sp = SamplingParams(temperature=args.temperature, seed=1 if args.temperature > 0 else None, ignore_eos=True,
                        max_new_tokens=args.steps + 4, return_routed_experts=args.routing)
    for p in torch.randint(2, V, (args.batch, args.prompt_len), generator=g).tolist():
        engine._add(engine._new_state(GenerateRequest(p, sp)))
    engine.step()  # prefill (one step: the prefill budget holds every prompt)
    engine.step()  # one decode step to warm up
    traffic = HostTraffic()
    with profile(activities=[ProfilerActivity.CPU]) as prof, traffic:
        for _ in range(args.steps):
            engine.step()
    report(count_profile(prof.events()), traffic.counts, args)


def report(phases, traffic, args) -> None:
    n = args.steps
    print(f"config {args.config}, batch {args.batch}, temperature {args.temperature}, routing {args.routing}, "
          f"graph stand-in {args.graph}; per decode step (mean of {n}):")
    total = collections.Counter()
    for phase in ("forward", "sample", "host"):
        c = phases.get(phase, collections.Counter())
        total.update(c)
        print(f"  {phase:8s} kernel launches {c['launches'] / n:8.1f}   sync ops {c['sync_ops'] / n:6.1f}")
    syncs = (total["sync_ops"] + traffic["d2h_read"] + traffic["h2d_blocking"]) / n
    print(f"  total    kernel launches {total['launches'] / n:8.1f}")
    print(f"  device->host syncs {syncs:.1f} = sync ops {total['sync_ops'] / n:.1f} + value reads "
          f"{traffic['d2h_read'] / n:.1f} + blocking host->device copies {traffic['h2d_blocking'] / n:.1f}; "
          f"async host->device copies {traffic['h2d_async'] / n:.1f}")


if __name__ == "__main__":
    main()
