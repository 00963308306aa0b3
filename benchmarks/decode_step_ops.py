"""Per decode step: how many kernels the engine would launch and how often it would stall on the host.

    python benchmarks/decode_step_ops.py --config 1b --batch 64                   # CPU, a few minutes
    python benchmarks/decode_step_ops.py --config tiny --batch 8 --temperature 0.8

Runs the engine on the CPU (no GPU needed), prefills --batch prompts, then records --steps
decode steps with torch.profiler and counts, per step:
- kernel launches: aten ops that run a kernel on a GPU (views, allocations and composite
  wrappers such as aten::linear -> aten::mm are not counted twice). With CUDA graphs the
  forward's ops are replayed as ONE graph launch: `--graph` runs the decode forward through
  the graph runner's eager stand-in (same static shapes, padding, fixed capacity) to count them;
- device->host syncs (lockstep.engine.sync_audit): reads of a tensor's values from Python
  (`.tolist()`, `.item()`, `int(t)`, `.cpu()`), ops whose output size depends on the data
  (`nonzero`, boolean-mask indexing, `unique`, `bincount`, ...), and blocking host->device
  copies of Python-built tensors (CUDA synchronises the stream before a copy from pageable
  memory); async (pinned, non_blocking) host->device copies are listed apart: they do not stall.
Per phase: forward (runner.execute), sample (the sampler), host (the rest of Engine.step).
On a GPU every sync drains the launch queue; these counts are what the decode step pays.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import build_model  # noqa: E402

from lockstep.config import EngineConfig, SamplingParams  # noqa: E402
from lockstep.engine import Engine, GenerateRequest  # noqa: E402
from lockstep.engine.sync_audit import SyncAudit  # noqa: E402

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


def count_profile(events) -> dict[str, collections.Counter]:
    """Kernel launches per phase (the lockstep:: range around an op).

    A launch is the outermost aten op that is neither a view nor a composite wrapper: what it
    calls on the CPU (wrapped Python scalars converted by aten::to, sum's fill_) is not counted."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    parent = {id(c): e for e in events for c in e.cpu_children}
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        op, anc, phase, under_launch = e.name[6:], parent.get(id(e)), "host", False
        while anc is not None:
            if anc.name.startswith("aten::"):
                up = anc.name[6:]
                under_launch |= up not in NO_KERNEL and up not in COMPOSITE
            elif anc.name.startswith("lockstep::") and phase == "host":
                phase = anc.name[10:]
            anc = parent.get(id(anc))
        if op not in NO_KERNEL and op not in COMPOSITE and not under_launch:
            out[phase]["launches"] += 1
    return out


def phased(fn, name, audits):
    """fn inside a profiler range and a SyncAudit of its own (audits[name])."""
    audits[name] = SyncAudit()

    def wrapped(*a, **k):
        with record_function(f"lockstep::{name}"), audits[name]:
            return fn(*a, **k)
    return wrapped


def instrument(engine: Engine, graph: bool) -> dict[str, SyncAudit]:
    if graph:  # the CUDA-graph runner, replaying its forward eagerly
        engine.adapter.enable_graphs(engine.config.max_num_seqs, capture=False)
    audits: dict[str, SyncAudit] = {}
    engine.runner.execute = phased(engine.runner.execute, "forward", audits)
    engine.sampler = phased(engine.sampler, "sample", audits)
    return audits


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
                                        max_prefill_tokens=args.batch * args.prompt_len,
                                        true_on_policy=False))  # the default decode step's ops
    audits = instrument(engine, args.graph)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    sp = SamplingParams(temperature=args.temperature, seed=1 if args.temperature > 0 else None, ignore_eos=True,
                        max_new_tokens=args.steps + 4, return_routed_experts=args.routing)
    for p in torch.randint(2, V, (args.batch, args.prompt_len), generator=g).tolist():
        engine._add(engine._new_state(GenerateRequest(p, sp)))
    engine.step()  # prefill (one step: the prefill budget holds every prompt)
    engine.step()  # one decode step to warm up
    for a in audits.values():
        a.counts.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof, SyncAudit() as whole:
        for _ in range(args.steps):
            engine.step()
    audits["host"] = whole
    for name in ("forward", "sample"):  # host = the step minus its two phases
        whole.counts.subtract(audits[name].counts)
    report(count_profile(prof.events()), audits, args)


def report(phases, audits, args) -> None:
    n = args.steps
    print(f"config {args.config}, batch {args.batch}, temperature {args.temperature}, routing {args.routing}, "
          f"graph stand-in {args.graph}; per decode step (mean of {n}):")
    total, syncs = 0.0, collections.Counter()
    for phase in ("forward", "sample", "host"):
        launches, audit = phases.get(phase, collections.Counter())["launches"] / n, audits[phase]
        total += launches
        syncs.update(audit.counts)
        print(f"  {phase:8s} kernel launches {launches:8.1f}   device->host syncs {audit.syncs / n:6.1f}   "
              + "  ".join(f"{k} {audit.counts[k] / n:.1f}" for k in KINDS))
    print(f"  step     kernel launches {total:8.1f}   device->host syncs "
          f"{sum(syncs[k] for k in KINDS[:3]) / n:6.1f}   (+ {syncs['h2d_async'] / n:.1f} async host->device copies)")


KINDS = ("value_reads", "sync_ops", "h2d_blocking", "h2d_async")


if __name__ == "__main__":
    main()
