"""Latency of mHC's projection with its RMSNorm as a Triton kernel against the torch expression.

The Triton path is `lockstep::hc_mix_partials` plus the split-K sum and the norm's scale in
torch ops (hc_projection_triton.hc_mixes); the torch expression is the one it replaces.

    python benchmarks/hc_projection.py                                     # GPU: T = 64, 512, 4096; J = 24, K = 4096
    python benchmarks/hc_projection.py --tokens 64 --split 16 --block-k 32 --num-warps 2

In a decode step at batch 64 each mHC call (2 per decoder layer, and HyperHead once per step)
computes mixes = F.linear(rms_norm(x.float(), eps), fn.float()) with x [T, K = n * D] bf16 and fn
[J, K] fp32 (J = 24; HyperHead's J = 4), 16-17 times per step, inside the step's CUDA graph. For
each --tokens count, three calls are timed in microseconds per call:
- triton: hc_projection_triton.hc_mixes, the kernel then the second stage as eager torch ops
  (sum over splits, rsqrt, multiply: a few small kernels; a compiled caller fuses them into its
  next element-wise kernel);
- kernel: hc_mix_partials alone, about what the triton path costs inside a compiled step;
- torch: the reference, rms_norm then F.linear (cuBLAS), as hyper_connection.py ran it;
each two ways: graph (--graph-calls back-to-back calls on distinct inputs captured in one CUDA
graph, replayed --reps times between CUDA events, after warm-up) and device (the calls' kernels'
device time as CUPTI reports it, torch.profiler over --profile-reps replays). Printed per
count: those timings, the ratio torch / triton (graph), and max |triton - torch| next to
max |torch|. Launch-config overrides (--split, --block-t, --block-k, --num-warps,
--num-stages; 0: the default of launch_config; --precision: tl.dot's) sweep the kernel. GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from cuda_graph_timing import add_timing_arguments, require_kernels, table_header, table_row, time_calls

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def inputs(tokens: int, K: int, count: int, dtype, seed: int, device) -> list[torch.Tensor]:
    """count inputs like the streams: ~N(0, 1) activations in dtype."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, K, generator=g).to(dtype).to(device) for _ in range(count)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 4096], help="rows T (decode: the batch)")
    ap.add_argument("--J", type=int, default=24, help="output columns ((2 + n) * n = 24; HyperHead: n = 4)")
    ap.add_argument("--K", type=int, default=4096, help="n * hidden_size (DeepSeek-V4 1b-style: 4 * 1024)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="the streams' dtype (fn is fp32)")
    ap.add_argument("--eps", type=float, default=1e-6)
    add_timing_arguments(ap, 16, "calls per CUDA graph (decode step: 16-17)")
    ap.add_argument("--split", type=int, default=0, help="splits of K (0: default_split(K))")
    ap.add_argument("--block-t", type=int, default=0, help="rows per program (0: launch_config's)")
    ap.add_argument("--block-k", type=int, default=0, help="K per tile (0: launch_config's)")
    ap.add_argument("--num-warps", type=int, default=0)
    ap.add_argument("--num-stages", type=int, default=0)
    ap.add_argument("--precision", choices=["tf32x3", "ieee", "tf32"], default="",
                    help="tl.dot's input precision (default: hc_projection_triton.PRECISION)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    require_kernels("hc_projection.py")

    from lockstep.models.layers import hc_projection_triton as hp
    from lockstep.models.layers.norm import rms_norm

    dtype = DTYPES[args.dtype]
    fn = (torch.randn(args.J, args.K, generator=torch.Generator().manual_seed(args.seed + 1)) * 0.02).cuda()
    if not hp.available(torch.empty(1, args.K, device="cuda", dtype=dtype), fn):
        sys.exit(f"the kernel does not run here (triton missing, or J = {args.J} > {hp.MAX_J})")
    split = args.split or hp.default_split(args.K)
    config = dict(block_t=args.block_t, block_k=args.block_k, num_warps=args.num_warps, num_stages=args.num_stages)
    calls = {
        "triton": lambda x: hp.hc_mixes(x, fn, args.eps, split, **config),
        "kernel": lambda x: hp.hc_mix_partials(x, fn, split, **config),
        "torch": lambda x: F.linear(rms_norm(x.float(), args.eps), fn.float()),
    }
    cfg = hp.launch_config(args.J, args.K, split)
    cfg.update({key: value for key, value in zip(cfg, config.values()) if value})
    cfg["precision"] = args.precision or hp.PRECISION
    config["precision"] = args.precision
    print(f"{torch.cuda.get_device_name()}: J = {args.J}, K = {args.K}, x {args.dtype}, split = {split}, {cfg}; "
          f"{args.graph_calls} calls per graph, {args.reps} reps; microseconds per call")
    print(table_header("tokens", calls, "torch/triton", ["max|diff|", "max|torch|"]))
    for tokens in args.tokens:
        xs = inputs(tokens, args.K, args.graph_calls, dtype, args.seed, "cuda")
        row = time_calls(calls, xs, args.reps, args.warmup, args.profile_reps)
        ours, ref = calls["triton"](xs[0]), calls["torch"](xs[0])
        diff, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
        print(table_row(tokens, row, calls, ("torch", "triton"), [f"{diff:.2e}", f"{scale:.2e}"]))


if __name__ == "__main__":
    main()
