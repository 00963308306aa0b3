"""Latency of mHC's fused Sinkhorn kernel (`lockstep::sinkhorn`) against the plain torch loop.

    python benchmarks/sinkhorn_kernel.py                                   # GPU: 64 tokens, n = 4, 20 iters
    python benchmarks/sinkhorn_kernel.py --tokens 64 512 8192 --graph-calls 16 --reps 500

The decode step at batch 64 calls the Sinkhorn on 64 tokens' 4 x 4 matrices (DeepSeek-V4:
hc_mult 4, 20 iterations) 16 times per step, inside the step's CUDA graph. For each --tokens
count, both ways of computing it, the fused kernel (sinkhorn_triton.sinkhorn_fused) and its
peer, the plain loop (sinkhorn.sinkhorn_reference: 39 normalisations of 3 small kernels), are
timed in microseconds per call three ways:
- kernel: device time of the call's kernels as CUPTI reports them (torch.profiler), replaying
  the graph below; for the fused kernel, the number a decode-step profile shows;
- graph: --graph-calls back-to-back calls, on distinct inputs, captured in one CUDA graph as the
  engine runs them, replayed --reps times between CUDA events (after warm-up);
- eager: --reps back-to-back calls between CUDA events (after warm-up); with launches from
  Python this is mostly launch overhead, the fused kernel's included.
Printed per count: the three timings of each, the ratio loop / fused (graph), and the numerics:
max |fused - loop|, and whether the fused kernel equals, bit for bit, the loop with each
line's sum added left to right (the kernel's order; torch's own sum may add in another order).
GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse
import sys

import torch

from cuda_graph_timing import add_timing_arguments, capture, graph_us, kernel_us, require_kernels

from lockstep.models.layers.sinkhorn import sinkhorn_in_kernel_order


def combs(tokens: int, n: int, count: int, seed: int, device) -> list[torch.Tensor]:
    """count inputs like mHC's: softmax over rows (+ eps), fp32."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.softmax(torch.randn(tokens, n, n, generator=g) * 3, dim=-1) + 1e-6).to(device)
            for _ in range(count)]


def numerics(fused, loop, x: torch.Tensor, iters: int, eps: float) -> tuple[float, bool]:
    """(max |fused - loop|, fused == in-order loop bit for bit) on one input."""
    out = fused(x, iters, eps)
    exact = torch.equal(out, sinkhorn_in_kernel_order(x, iters, eps))
    return (out - loop(x, iters, eps)).abs().max().item(), exact


def eager_us(call, xs, reps: int, warmup: int) -> float:
    for i in range(warmup):
        call(xs[i % len(xs)])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for i in range(reps):
        call(xs[i % len(xs)])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64], help="token counts (decode: the batch)")
    ap.add_argument("--n", type=int, default=4, help="matrix size (hc_mult; DeepSeek-V4: 4)")
    ap.add_argument("--iters", type=int, default=20, help="Sinkhorn iterations (DeepSeek-V4: 20)")
    ap.add_argument("--eps", type=float, default=1e-6)
    add_timing_arguments(ap, 16, "calls per CUDA graph (decode step: 16)", "timed calls (eager) or graph replays",
                         "graph replays under the profiler (kernel column)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    require_kernels("sinkhorn_kernel.py")

    from lockstep.models.layers import sinkhorn_triton
    from lockstep.models.layers.sinkhorn import sinkhorn_reference

    probe = torch.empty(1, args.n, args.n, device="cuda")
    if not sinkhorn_triton.available(probe):
        sys.exit(f"the fused kernel does not run here (triton missing, or n = {args.n} > {sinkhorn_triton.MAX_N})")
    fused, loop = sinkhorn_triton.sinkhorn_fused, sinkhorn_reference
    print(f"{torch.cuda.get_device_name()}: n = {args.n}, iters = {args.iters}, "
          f"{args.graph_calls} calls per graph, {args.reps} reps; microseconds per call")
    print(f"{'tokens':>7} | {'fused: kernel':>13} {'graph':>7} {'eager':>7} | {'loop: kernel':>12} {'graph':>7} "
          f"{'eager':>7} | {'loop/fused':>10} | {'max|fused-loop|':>15} {'bitwise':>7}")
    for tokens in args.tokens:
        xs = combs(tokens, args.n, args.graph_calls, args.seed, "cuda")
        row = {}
        for name, fn in (("fused", fused), ("loop", loop)):
            call = lambda x, fn=fn: fn(x, args.iters, args.eps)  # noqa: E731
            graph, _outputs = capture(call, xs)
            row[name] = (kernel_us(graph, args.graph_calls, args.profile_reps),
                         graph_us(graph, args.graph_calls, args.reps, args.warmup),
                         eager_us(call, xs, args.reps, args.warmup))
            del graph, _outputs
        diff, bitwise = numerics(fused, loop, xs[0], args.iters, args.eps)
        (fk, fg, fe), (lk, lg, le) = row["fused"], row["loop"]
        print(f"{tokens:>7} | {fk:>13.2f} {fg:>7.2f} {fe:>7.2f} | {lk:>12.2f} {lg:>7.2f} {le:>7.2f} | "
              f"{lg / fg:>9.1f}x | {diff:>15.2e} {'yes' if bitwise else 'NO':>7}")


if __name__ == "__main__":
    main()
