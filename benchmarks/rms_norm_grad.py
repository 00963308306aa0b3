"""The trainer's RMSNorm backward (models/layers/rms_norm_grad_triton.py) against the eager ops'
autograd and against the copy bandwidth, at a training batch's row count.

    python benchmarks/rms_norm_grad.py                      # GPU: 16,384 rows (8 x 2048), D 128 ... 4096
    python benchmarks/rms_norm_grad.py --rows 16384 --dims 1024

Per row length D, bf16 activations and an fp32 weight (as the trainer keeps them), the backward of
y = weight * RMSNorm(x) for a gradient of y, timed three ways (cuda_graph_timing.py: --graph-calls
calls on distinct inputs in one CUDA graph, replayed --reps times; us per call):
- kernels: `rms_norm_backward` with d w (where a row fits one tile, D <= 1024, one kernel for both
  and the sum of its shares; wider, the d x kernel, the d w kernel and the sum of its shares);
- two kernels: the same with d x and d w by their own kernels at every D (`one_kernel=False`);
- dx: the same without d w (the d x kernel alone: d w costs the difference);
- eager: torch.autograd.grad through norm.py's eager formula (the trainer with triton_norm off).
The bytes the backward must move (x and the gradient read, d x written, at 2 bytes each) over the
kernels' time, as a fraction of the device copy bandwidth measured in the same run, is the
physical bound; then eager / kernels and the largest |d x|, |d w| difference to eager.
GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse

import torch

from cuda_graph_timing import add_timing_arguments, require_kernels, time_calls
from rollout_throughput import copy_bandwidth

from lockstep.models.layers import rms_norm_grad_triton as grad_kernels
from lockstep.models.layers.norm import inverse_rms

EPS = 1e-6


def eager_backward(x: torch.Tensor, weight: torch.Tensor, g: torch.Tensor):
    xl, wl = x.detach().requires_grad_(), weight.detach().requires_grad_()
    xf = xl.float()
    y = (wl * (xf * inverse_rms(xf, EPS))).to(x.dtype)
    return torch.autograd.grad(y, (xl, wl), g)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384, help="tokens of the micro-batch")
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 512, 1024, 4096], help="row lengths D")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth probe")
    add_timing_arguments(ap, 8, "backward calls per CUDA graph (distinct inputs)")
    args = ap.parse_args(argv)
    require_kernels("rms_norm_grad.py", grad_kernels)
    bw = copy_bandwidth("cuda", args.copy_mib)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.1f} GB/s; {args.rows} rows, bf16 x, fp32 weight")
    print(f"{'D':>6} | {'kernels us':>10} {'two us':>8} {'dx us':>8} {'eager us':>9} | {'GB/s':>7} {'of copy':>7} | "
          f"{'eager/kernels':>13} | {'max|ddx|':>9} {'max|ddw|':>9}")
    g = torch.Generator().manual_seed(0)
    for D in args.dims:
        xs = [(torch.randn(args.rows, D, generator=g) * 2).bfloat16().cuda() for _ in range(args.graph_calls)]
        gs = [torch.randn(args.rows, D, generator=g).bfloat16().cuda() for _ in range(args.graph_calls)]
        weight = (torch.rand(D, generator=g) + 0.5).cuda()
        pairs = list(zip(xs, gs))
        row = time_calls({
            "kernels": lambda p: grad_kernels.rms_norm_backward(p[0], weight, p[1], EPS, with_dw=True),
            "two kernels": lambda p: grad_kernels.rms_norm_backward(p[0], weight, p[1], EPS, with_dw=True,
                                                                    one_kernel=False),
            "dx": lambda p: grad_kernels.rms_norm_backward(p[0], weight, p[1], EPS, with_dw=False),
            "eager": lambda p: eager_backward(p[0], weight, p[1]),
        }, pairs, args.reps, args.warmup, args.profile_reps)
        us = row["kernels"][0]
        gbs = 3 * 2 * args.rows * D / us / 1e3
        dx, dw = grad_kernels.rms_norm_backward(xs[0], weight, gs[0], EPS, with_dw=True)
        ex, ew = eager_backward(xs[0], weight, gs[0])
        print(f"{D:>6} | {us:>10.1f} {row['two kernels'][0]:>8.1f} {row['dx'][0]:>8.1f} {row['eager'][0]:>9.1f} | "
              f"{gbs:>7.0f} "
              f"{gbs * 1e9 / bw:>7.1%} | {row['eager'][0] / us:>12.2f}x | "
              f"{(dx.float() - ex.float()).abs().max().item():>9.3g} {(dw - ew).abs().max().item():>9.3g}")
        del xs, gs, pairs


if __name__ == "__main__":
    main()
