"""Latency of a decode step's attention read from the caches in place (one Triton kernel) against
the torch form it replaces (keys gathered and concatenated, a bias, sink attention).

    python benchmarks/step_attention.py                      # GPU: batch 64, 16 heads x 128, window 128
    python benchmarks/step_attention.py --context 192 8192 --kinds window closed picked

Each sequence's one new token attends to its window ring (the 1b config's 128 keys) and, by layer
kind, to nothing more (window), to every closed block of its compressed entries (closed: the C128
layers, rate 128) or to the indexer's --picks entries of rate-4 blocks (picked: the C4 layers;
the torch form attends over every entry of the cache's capacity, the picks' bias masking the rest,
as the engine's CUDA graphs do). The caches hold --context positions per sequence (capacity
--context + 1 positions). One shared K = V head, a sink logit per head. Three calls, in microseconds
per call:
- kernel: step_attention_triton.sink_attention_step (`lockstep::sink_attention_step`), reading
  the ring and the entries through the slots (and picks);
- compiled: the torch form (window_ring.read_window, the concatenations, window_bias /
  closed_block_bias or the picks' bias, pad_keys, sink_attention.sink_attention) under torch.compile
  (inductor, dynamic shapes, as the engine compiles its decoder layers);
- eager: the same torch form uncompiled;
each two ways (cuda_graph_timing.py): graph (--graph-calls back-to-back calls on distinct inputs
in one CUDA graph, replayed --reps times) and device (the calls' kernels' device time, CUPTI).
Printed per (kind, context): those timings, the ratio compiled / kernel (graph), and max |kernel -
torch form| next to max |torch form|. GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse

import torch

from cuda_graph_timing import add_timing_arguments, require_kernels, table_header, table_row, time_calls
from lockstep.models.layers import step_attention_triton as sa
from lockstep.models.layers.sink_attention import closed_block_bias, pad_keys, sink_attention, window_bias
from lockstep.models.layers.window_ring import read_window


RATES = {"window": 0, "closed": 128, "picked": 4}


def inputs(args, kind: str, context: int, seed: int) -> list[dict]:
    """--graph-calls decode steps' tensors, bf16: queries, the token's key, a ring and entries per slot
    (the slots shuffled), the picks (distinct visible entries, ascending) where kind is picked."""
    g = torch.Generator().manual_seed(seed)
    N, H, D, W, rate = args.batch, args.heads, args.head_dim, args.window, RATES[kind]
    out = []
    for _ in range(args.graph_calls):
        x = dict(q=torch.randn(N, 1, H, D, generator=g), kv=torch.randn(N, 1, D, generator=g),
                 ring=torch.randn(N + 1, W, D, generator=g), slots=torch.randperm(N, generator=g),
                 positions=torch.full((N, 1), context))
        if rate:
            x["entries"] = torch.randn(N + 1, (context + 1) // rate + 1, D, generator=g)
        if kind == "picked":
            closed = (context + 1) // rate
            x["picks"] = torch.stack([torch.randperm(closed, generator=g)[:args.picks].sort().values
                                      for _ in range(N)]).unsqueeze(1)
        out.append({k: (v.bfloat16() if v.is_floating_point() else v).cuda() for k, v in x.items()})
    return out


def torch_form(x: dict, sinks, scale: float, rate: int) -> torch.Tensor:
    """The keys assembled by torch ops (DeepseekV4Attention._attend_gathered's), then sink attention."""
    positions = x["positions"]
    ring_keys, ring_pos = read_window(x["ring"], x["slots"], positions[:, 0])
    keys = torch.cat([ring_keys, x["kv"]], dim=1)
    k_pos = torch.cat([ring_pos, positions], dim=1)
    bias = window_bias(positions, k_pos, torch.cat([ring_pos >= 0, positions >= 0], dim=1), x["ring"].shape[1])
    if "entries" in x:
        entries = x["entries"][x["slots"]]
        if "picks" in x:
            chosen = torch.zeros(*x["picks"].shape[:2], entries.shape[1], dtype=torch.bool, device=entries.device)
            chosen.scatter_(-1, x["picks"], True)
            comp_bias = torch.zeros(chosen.shape, device=entries.device).masked_fill(~chosen, float("-inf"))
        else:
            comp_bias = closed_block_bias(positions, entries.shape[1], rate)
        keys, bias = torch.cat([keys, entries], dim=1), torch.cat([bias, comp_bias], dim=2)
    keys, bias = pad_keys(keys, bias)
    return sink_attention(x["q"], keys, bias, sinks, scale)


def with_token_written(x: dict) -> dict:
    """x with the token's key in its ring (window_ring.write_window), as the kernel reads it."""
    ring = x["ring"].clone()
    ring[x["slots"], x["positions"][:, 0] % ring.shape[1]] = x["kv"][:, 0]
    return {**x, "ring": ring}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64, help="sequences in the step")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--picks", type=int, default=128, help="the C4 indexer's index_topk (picked)")
    ap.add_argument("--context", type=int, nargs="+", default=[192, 2048], help="positions cached per sequence")
    ap.add_argument("--kinds", nargs="+", choices=list(RATES), default=list(RATES))
    add_timing_arguments(ap, 8, "calls per CUDA graph (decode step: one per layer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    require_kernels("step_attention.py", sa)
    sinks = torch.randn(args.heads, generator=torch.Generator().manual_seed(args.seed + 1)).cuda()
    scale = args.head_dim ** -0.5
    compiled = torch.compile(torch_form, dynamic=True)
    print(f"{torch.cuda.get_device_name()}: batch {args.batch}, {args.heads} heads x {args.head_dim}, window "
          f"{args.window}, bf16; {args.graph_calls} calls per graph, {args.reps} reps; microseconds per call")
    for kind in args.kinds:
        rate = RATES[kind]
        calls = {
            "kernel": lambda x: sa.sink_attention_step(x["q"], x["ring"], x["slots"], x["positions"], sinks, scale,
                                                       x.get("entries"), x.get("picks"), rate),
            "compiled": lambda x: compiled(x, sinks, scale, rate),
            "eager": lambda x: torch_form(x, sinks, scale, rate),
        }
        print(table_header(f"{kind} context", calls, "compiled/kernel", ["max|diff|", "max|torch|"]))
        for context in args.context:
            xs = inputs(args, kind, context, args.seed)
            written = [with_token_written(x) for x in xs]
            row = time_calls({"kernel": calls["kernel"]}, written, args.reps, args.warmup, args.profile_reps)
            row.update(time_calls({k: calls[k] for k in ("compiled", "eager")}, xs, args.reps, args.warmup,
                                  args.profile_reps))
            ours, ref = calls["kernel"](written[0]).float(), calls["eager"](xs[0]).float()
            diff, size = (ours - ref).abs().max().item(), ref.abs().max().item()
            print(table_row(context, row, calls, ("compiled", "kernel"), [f"{diff:.2e}", f"{size:.2e}"]))


if __name__ == "__main__":
    main()
