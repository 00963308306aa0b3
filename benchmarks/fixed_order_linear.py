"""The fixed-order (batch-invariant) GEMM of the true-on-policy forward against cuBLAS, on the 1b
config's GEMM shapes, at decode's row count and at a prefill / training row count.

    python benchmarks/fixed_order_linear.py                         # GPU: M = 64 and 4096, bf16
    python benchmarks/fixed_order_linear.py --rows 64 --split-k 1   # the unsplit kernel for comparison

fixed_order_linear.py's kernel walks K in a fixed order and picks its tiles and its split of K from
(N, K) only, so a row's bits cannot depend on M; cuBLAS picks by M (that is why its rows differ
between a decode step and a training forward). Per shape and row count, microseconds per call of
- fixed: `lockstep::fixed_order_linear` with its default launch config (split K where the column
  tiles are few), or --split-k / --block-* overrides;
- cublas: x @ w^T (bf16; the head's fp32 output: the upcast GEMM, as the default path's head);
each as --graph-calls back-to-back calls on distinct inputs captured in one CUDA graph, replayed
--reps times (cuda_graph_timing.py: launch overhead out, as in the engine's decode graphs). Printed:
both times and the ratio cublas / fixed (1.0: as fast as cuBLAS). GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse

import torch

from cuda_graph_timing import capture, graph_us, require_kernels

# (name, N, K, fp32 output): the 1b config (rollout_throughput.py) per layer, and the LM head
SHAPES = [("wq_a", 512, 1024, False), ("wkv", 128, 1024, False), ("wq_b", 2048, 512, False),
          ("wo_a group", 256, 512, False), ("wo_b", 1024, 1024, False), ("index wq_b", 1024, 512, False),
          ("shared gate", 512, 1024, False), ("shared down", 1024, 512, False), ("head", 32768, 1024, True)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 4096], help="M (decode: the batch)")
    ap.add_argument("--split-k", type=int, default=0, help="0: launch_config's")
    ap.add_argument("--block-m", type=int, default=0)
    ap.add_argument("--block-n", type=int, default=0)
    ap.add_argument("--block-k", type=int, default=0)
    ap.add_argument("--graph-calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    require_kernels("fixed_order_linear.py")
    from lockstep.models.layers import fixed_order_linear as fol

    overrides = dict(split_k=args.split_k, block_m=args.block_m, block_n=args.block_n, block_k=args.block_k)
    g = torch.Generator().manual_seed(args.seed)
    print(f"{'shape':12s} {'N':>6s} {'K':>5s} {'M':>5s} {'split':>5s} {'fixed us':>9s} {'cublas us':>9s} {'ratio':>6s}")
    for M in args.rows:
        for name, N, K, fp32_out in SHAPES:
            w = torch.randn(N, K, generator=g).bfloat16().cuda()
            xs = [torch.randn(M, K, generator=g).bfloat16().cuda() for _ in range(args.graph_calls)]
            fixed, _ = capture(lambda x: torch.ops.lockstep.fixed_order_linear(x, w, fp32_out=fp32_out, **overrides), xs)
            wf = w.float() if fp32_out else w
            cublas, _ = capture((lambda x: x.float() @ wf.T) if fp32_out else (lambda x: x @ w.T), xs)
            t_fixed = graph_us(fixed, args.graph_calls, args.reps, warmup=3)
            t_cublas = graph_us(cublas, args.graph_calls, args.reps, warmup=3)
            split = args.split_k or fol.launch_config(N, K)["SPLIT_K"]
            print(f"{name:12s} {N:6d} {K:5d} {M:5d} {split:5d} {t_fixed:9.1f} {t_cublas:9.1f} {t_cublas / t_fixed:6.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
