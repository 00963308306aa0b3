"""Latency of mHC's pre stage at a decode step as two kernels against the torch chain they replace.

    python benchmarks/hc_pre.py                       # GPU: batch 64, n = 4 streams of 1024 (the 1b config)
    python benchmarks/hc_pre.py --batch 8 64 256 --hidden 4096

Each mHC call of a decode step projects its tokens' flattened streams onto 24 mixes, turns them
into the coefficients (pre, post, Sinkhorn of comb) and collapses the streams into the block's
input. Three forms of the whole stage are timed in microseconds per call:
- kernels: hyper_connection.pre_step, the projection's partials kernel then hc_pre_triton's
  `lockstep::hc_pre_step` (mixes, coefficients, Sinkhorn, collapse in one);
- compiled: the torch chain under torch.compile (inductor, dynamic shapes, as the engine compiles
  its decoder layers): the partials kernel, inductor's sums and element-wise kernels, the fused
  Sinkhorn kernel, the collapse;
- eager: the same chain uncompiled;
each two ways (cuda_graph_timing.py): graph (--graph-calls back-to-back calls on distinct inputs in
one CUDA graph, replayed --reps times) and device (the calls' kernels' device time, CUPTI).
Printed per batch: those timings, the ratio compiled / kernels (graph), and the largest difference
of the block input and of comb between the kernels and the eager chain. GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse

import torch

from cuda_graph_timing import add_timing_arguments, require_kernels, table_header, table_row, time_calls

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6  # DeepSeek-V4's Sinkhorn iterations and epsilons


def inputs(batch: int, n: int, hidden: int, count: int, seed: int) -> list[torch.Tensor]:
    """count decode steps' streams [batch, 1, n, hidden], bf16."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 1, n, hidden, generator=g) * 3).bfloat16().cuda() for _ in range(count)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64], help="tokens in the step")
    ap.add_argument("--streams", type=int, default=4, help="hc_mult")
    ap.add_argument("--hidden", type=int, default=1024)
    add_timing_arguments(ap, 16, "calls per CUDA graph (decode step: two per layer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from lockstep.models.layers import hc_pre_triton
    from lockstep.models.layers.hyper_connection import _coefficients, _collapse, _mixes, pre_step

    require_kernels("hc_pre.py", hc_pre_triton)
    n, D = args.streams, args.hidden
    g = torch.Generator().manual_seed(args.seed + 1)
    fn = (torch.randn((2 + n) * n, n * D, generator=g) * (n * D) ** -0.5).cuda()
    base, scale = torch.randn((2 + n) * n, generator=g).cuda(), (torch.rand(3, generator=g) + 0.5).cuda()

    def chain(streams):
        mixes = _mixes(streams, fn, NORM_EPS, True)
        pre, post, comb = _coefficients(mixes, base, scale, n, ITERS, HC_EPS)
        return _collapse(pre, streams), post, comb

    compiled = torch.compile(chain, dynamic=True)
    calls = {
        "kernels": lambda x: pre_step(x, fn, base, scale, ITERS, HC_EPS, NORM_EPS),
        "compiled": compiled,
        "eager": chain,
    }
    print(f"{torch.cuda.get_device_name()}: n {n} x {D}, bf16 streams; {args.graph_calls} calls per graph, "
          f"{args.reps} reps; microseconds per call")
    print(table_header("batch", calls, "compiled/kernels", ["max|dx|", "max|dcomb|"]))
    with torch.no_grad():
        for batch in args.batch:
            xs = inputs(batch, n, D, args.graph_calls, args.seed)
            row = time_calls(calls, xs, args.reps, args.warmup, args.profile_reps)
            (x, _, comb), (ref_x, _, ref_comb) = calls["kernels"](xs[0]), chain(xs[0])
            dx, dcomb = (x.float() - ref_x.float()).abs().max().item(), (comb - ref_comb).abs().max().item()
            print(table_row(batch, row, calls, ("compiled", "kernels"), [f"{dx:.2e}", f"{dcomb:.2e}"]))


if __name__ == "__main__":
    main()
