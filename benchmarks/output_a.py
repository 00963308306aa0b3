"""Latency of a decode step's attention output up to wo_a (V's rotation undone, then the grouped
projection) as one Triton kernel against the torch ops it replaces.

    python benchmarks/output_a.py                  # GPU: batch 8, 64, 256; the 1b config's shapes
    python benchmarks/output_a.py --sweep          # also the kernel's launch settings, per format

Per format (bf16 weights; packed fp8, fp8_linear.py):
- kernel: output_a_triton.derope_output_a (`lockstep::derope_output_a`);
- compiled: attention._output's rotation (rope.apply_rope with -sin) and wo_a (GroupedLinear's
  einsum, or Fp8Linear's fp8 kernel) under torch.compile (inductor, dynamic shapes, as the engine
  compiles its decoder layers);
each two ways (cuda_graph_timing.py): graph and device, microseconds per call; the ratio compiled /
kernel (graph) and max |kernel - compiled|. GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse

import torch

from cuda_graph_timing import (add_timing_arguments, capture, fastest, graph_us, require_kernels, table_header,
                               table_row, time_calls)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256], help="tokens in the step")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--rank", type=int, default=256, help="o_lora_rank: wo_a's outputs a group")
    ap.add_argument("--sweep", action="store_true", help="also sweep the kernel's launch settings (batch 64)")
    add_timing_arguments(ap, 8, "calls per CUDA graph (decode step: one per layer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from lockstep.models.layers import output_a_triton
    from lockstep.models.layers.attention import GroupedLinear
    from lockstep.models.layers.fp8_linear import Fp8Linear
    from lockstep.models.layers.rope import apply_rope, default_inv_freq, rope_cos_sin

    require_kernels("output_a.py", output_a_triton)
    torch.manual_seed(args.seed)
    H, D, G = args.heads, args.head_dim, args.groups
    wo_a = GroupedLinear(H * D // G, G * args.rank, G).cuda().bfloat16()
    torch.nn.init.normal_(wo_a.weight, std=(H * D // G) ** -0.5)
    packed = Fp8Linear.packing(wo_a)
    formats = {"bf16": (wo_a, (wo_a.weight, G)),  # format: (the module, the kernel's weight arguments)
               "fp8": (packed, (packed.weight.view(torch.uint8), G, packed.weight_scale, packed.scale_row))}
    inv_freq = default_inv_freq(args.rope_dim, 10_000.0).cuda()
    print(f"{torch.cuda.get_device_name()}: {H} heads x {D}, rope {args.rope_dim}, {G} groups of {args.rank}; "
          f"{args.graph_calls} calls per graph, {args.reps} reps; microseconds per call")
    for fmt, (module, weights) in formats.items():
        def torch_ops(x, module=module):
            o, cos, sin = x
            rotated = apply_rope(o, cos.unsqueeze(-2), -sin.unsqueeze(-2))
            return module(rotated.reshape(o.shape[0], G, -1))

        kernel = lambda x, weights=weights, **cfg: output_a_triton.derope_output_a(*x, *weights, **cfg)  # noqa: E731
        calls = {"kernel": kernel, "compiled": torch.compile(torch_ops, dynamic=True)}
        print(f"{fmt} weights")
        print(table_header("batch", calls, "compiled/kernel", ["max|diff|"]))
        for batch in args.batch:
            xs = []
            for _ in range(args.graph_calls):
                cos, sin = rope_cos_sin(inv_freq, torch.randint(0, 4096, (batch,), device="cuda"))
                xs.append((torch.randn(batch, H, D, device="cuda").bfloat16(), cos, sin))
            row = time_calls(calls, xs, args.reps, args.warmup, args.profile_reps)
            diff = (kernel(xs[0]).float() - torch_ops(xs[0]).float()).abs().max().item()
            print(table_row(batch, row, calls, ("compiled", "kernel"), [f"{diff:10.2e}"]))
            if args.sweep and batch == 64:
                _sweep(kernel, xs, args)


def _sweep(kernel, xs, args) -> None:
    # one pipeline stage (two were slower in every setting of the 2026-12-04 sweep, launch_config), 16 or 32
    # columns (64 was slower); larger K steps and split K (the same inputs over more programs) as of 2026-12-05
    grid = {"block_n": [16, 32], "block_k": [128, 256, 512], "num_warps": [4, 8], "num_stages": [1],
            "split_k": [1, 2, 4]}

    def timed(cfg):
        graph, _ = capture(lambda x: kernel(x, **cfg), xs)
        return graph_us(graph, len(xs), args.reps, args.warmup)

    results = fastest(grid, lambda cfg: kernel(xs[0], **cfg), timed, kernel(xs[0]))
    for us, cfg, err in results[:6]:
        print(f"        {us:6.2f} us  {cfg}  max |diff to the default| {err:.1e}")


if __name__ == "__main__":
    main()
