"""Latency of a decode step's core attention as one Triton kernel against the torch form it replaces.

    python benchmarks/step_attention.py                        # GPU: batch 64, 16 heads x 128, 136 and 184 keys
    python benchmarks/step_attention.py --keys 136 1032 --batch 32

A decode step attends each sequence's one new token over the keys it assembled (the 1b config at
64 + 128 tokens: a window layer's 128 ring keys + the token, padded to 136; a CSA layer's 184 with
the compressed entries) with one shared K = V head and a sink logit per head. Three calls are
timed in microseconds per call:
- kernel: step_attention_triton.sink_attention_step (`lockstep::sink_attention_step`);
- compiled: sink_attention.sink_attention under torch.compile (inductor, dynamic shapes, as the
  engine compiles its decoder layers; the kernel replaces this inside them);
- eager: the same torch form uncompiled;
each two ways (cuda_graph_timing.py): graph (--graph-calls back-to-back calls on distinct inputs
in one CUDA graph, replayed --reps times) and device (the calls' kernels' device time, CUPTI).
Printed per key count: those timings, the ratio compiled / kernel (graph), and max |kernel -
torch form| next to max |torch form|. GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse
import sys

import torch

from cuda_graph_timing import add_timing_arguments, table_header, table_row, time_calls


def inputs(batch: int, heads: int, dim: int, keys: int, count: int, seed: int) -> list[tuple]:
    """count (q, kv, bias) like a decode step's, bf16, a quarter of the keys masked (-inf)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        q = torch.randn(batch, 1, heads, dim, generator=g).bfloat16()
        kv = torch.randn(batch, keys, dim, generator=g).bfloat16()
        bias = torch.zeros(batch, 1, keys).masked_fill(torch.rand(batch, 1, keys, generator=g) < 0.25, float("-inf"))
        out.append((q.cuda(), kv.cuda(), bias.cuda()))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64, help="sequences in the step")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--keys", type=int, nargs="+", default=[136, 184], help="keys per sequence (padded to 8)")
    add_timing_arguments(ap, 8, "calls per CUDA graph (decode step: one per layer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("step_attention.py times CUDA kernels: no GPU here")

    from lockstep.models.layers import step_attention_triton as sa
    from lockstep.models.layers.sink_attention import sink_attention

    if sa.triton is None:
        sys.exit("the kernel does not run here: triton is not installed")
    sinks = torch.randn(args.heads, generator=torch.Generator().manual_seed(args.seed + 1)).cuda()
    scale = args.head_dim ** -0.5
    compiled = torch.compile(sink_attention, dynamic=True)
    calls = {
        "kernel": lambda x: sa.sink_attention_step(*x, sinks, scale),
        "compiled": lambda x: compiled(*x, sinks, scale),
        "eager": lambda x: sink_attention(*x, sinks, scale),
    }
    print(f"{torch.cuda.get_device_name()}: batch {args.batch}, {args.heads} heads x {args.head_dim}, bf16; "
          f"{args.graph_calls} calls per graph, {args.reps} reps; microseconds per call")
    print(table_header("keys", calls, "compiled/kernel", ["max|diff|", "max|torch|"]))
    for keys in args.keys:
        xs = inputs(args.batch, args.heads, args.head_dim, keys, args.graph_calls, args.seed)
        row = time_calls(calls, xs, args.reps, args.warmup, args.profile_reps)
        ours, ref = calls["kernel"](xs[0]).float(), calls["eager"](xs[0]).float()
        diff, size = (ours - ref).abs().max().item(), ref.abs().max().item()
        print(table_row(keys, row, calls, ("compiled", "kernel"), [f"{diff:.2e}", f"{size:.2e}"]))


if __name__ == "__main__":
    main()
