"""Latency of a decode step's MoE dispatch order as one Triton kernel against the torch ops it replaces.

    python benchmarks/dispatch_order.py                  # GPU: batch 8, 64, 256; 64 experts, k = 6 (1b config)

Each MoE layer of a decode step sorts its T x k slots by expert (moe.dispatch_order, counting form):
- kernel: dispatch_order_triton.dispatch_order_step (`lockstep::dispatch_order_step`);
- compiled: moe.dispatch_order's torch ops under torch.compile (inductor, dynamic shapes, as the
  engine compiles its decoder layers: in the step, six inductor kernels and a scatter);
- eager: the same uncompiled;
each two ways (cuda_graph_timing.py): graph (--graph-calls calls on distinct inputs in one CUDA
graph, replayed --reps times) and device (the calls' kernels' device time, CUPTI). Printed per batch,
in microseconds per call: those timings, the ratio compiled / kernel (graph), and whether the
kernel's order and counts equal the torch ops' (and each "decode bB" form's outputs the default's).
--block B: also the decode step's form (`lockstep::decode_dispatch`, what the step runs: the gather's
rows, the group offsets, the combine's slot rows) with B slots a program, in a column "decode bB".
GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse

import torch

from cuda_graph_timing import add_timing_arguments, require_kernels, table_header, table_row, time_calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256], help="tokens in the step")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--block", type=int, nargs="*", default=[],
                    help="also time the decode step's form (dispatch_order_triton.decode_dispatch, the shared "
                         "expert's groups folded) with these slots a program (0: dispatch_order_triton.DECODE_BLOCK)")
    add_timing_arguments(ap, 8, "calls per CUDA graph (decode step: one per MoE layer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from lockstep.models.layers import dispatch_order_triton, grouped_gemm_triton, moe

    require_kernels("dispatch_order.py", dispatch_order_triton)
    g = torch.Generator().manual_seed(args.seed)
    torch_ops = lambda flat: moe.counting_order(flat, args.experts)  # noqa: E731
    calls = {"kernel": lambda flat: dispatch_order_triton.dispatch_order_step(flat, args.experts),
             "compiled": torch.compile(torch_ops, dynamic=True), "eager": torch_ops}
    shared = grouped_gemm_triton.SHARED_GROUPS
    for b in args.block:
        calls[f"decode b{b}"] = lambda flat, b=b: dispatch_order_triton.decode_dispatch(
            flat, args.experts, args.top_k, shared, b)
    print(f"{torch.cuda.get_device_name()}: {args.experts} experts, top {args.top_k}; "
          f"{args.graph_calls} calls per graph, {args.reps} reps; microseconds per call")
    print(table_header("batch", calls, "compiled/kernel", ["equal"]))
    for batch in args.batch:
        def step_ids():  # a step's expert ids: top_k distinct experts a token
            return torch.stack([torch.randperm(args.experts, generator=g)[:args.top_k] for _ in range(batch)])
        xs = [step_ids().flatten().cuda() for _ in range(args.graph_calls)]
        row = time_calls(calls, xs, args.reps, args.warmup, args.profile_reps)
        same = all(torch.equal(a, b) for a, b in zip(calls["kernel"](xs[0]), torch_ops(xs[0])))
        if args.block:  # each setting's outputs against the default's
            decoded = dispatch_order_triton.decode_dispatch(xs[0], args.experts, args.top_k, shared)
            same = same and all(torch.equal(a, b) for block in args.block
                                for a, b in zip(calls[f"decode b{block}"](xs[0]), decoded))
        print(table_row(batch, row, calls, ("compiled", "kernel"), [str(same)]))


if __name__ == "__main__":
    main()
