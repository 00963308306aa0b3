"""The packed fp8 linears at a decode step: the Triton W8A16 GEMM (models/layers/fp8_linear.py) vs
cuBLAS on the same weights in bf16, per shape of the 1b config.

    python benchmarks/fp8_linear.py                  # 1b decode shapes, batch 64
    python benchmarks/fp8_linear.py --sweep          # + the kernel's tile sizes per shape

The shapes are the 1b model's linears that the fp8 format stores as fp8 (quant/serving_format.py,
as engine/packed_weights.py packs them; the engine may fuse several that read the same input),
each with its count in the model. Each is timed as a decode step runs it: --calls calls captured
back to back in one CUDA graph (cuda_graph_timing.py), cycling over enough copies of the weight
that a call reads it from memory, not from a 50 MB L2 (a step reads ~1.9 GB of weights), then
replayed --reps times. Printed per shape: us per call for bf16 (F.linear; the grouped wo_a as the
model's einsum) and fp8, the GB/s of the bytes each must read (2 and 1 per parameter) as a
fraction of the device copy bandwidth, and the step's total over the model's count of each shape.
--sweep times a grid of (block_n weight rows, block_m tokens, num_warps) per shape.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from cuda_graph_timing import capture, fastest, graph_us, require_kernels
from rollout_throughput import bench_config, copy_bandwidth

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.layers import fp8_linear as fl
from lockstep.engine.packed_weights import stored_as
from lockstep.quant.formats import Storage
from lockstep.quant.fp8 import quantize_fp8_block

SWEEP = dict(block_n=(16, 32, 64, 128), block_m=(16, 32, 64), num_warps=(2, 4))
L2_BYTES = 64 << 20  # more than an H200's 50 MB L2


def fp8_shapes(config) -> Counter:
    """(out, in, n_groups) -> count of the model's linears the fp8 format stores as fp8."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    is_fp8 = stored_as("fp8", Storage.FP8)
    return Counter((*m.weight.shape, getattr(m, "n_groups", 0)) for name, m in model.named_modules()
                   if fl.packable(m) and is_fp8(f"{name}.weight"))


def copies(out: int, inp: int) -> int:
    return max(2, -(-2 * L2_BYTES // (out * inp)))  # bf16 copies past the L2 (fp8 ones: twice that)


def time_shape(args, out: int, inp: int, groups: int) -> dict:
    n = copies(out, inp)
    ws = [torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * inp**-0.5 for _ in range(n)]
    packed = [(q, s) for q, s in (quantize_fp8_block(w, scale_fmt="ue8m0") for w in ws)]
    scale_row = fl.block_scale_rows(out).cuda()
    G = max(groups, 1)
    x = torch.randn(args.batch, G, inp, device="cuda", dtype=torch.bfloat16) if groups else \
        torch.randn(args.batch, inp, device="cuda", dtype=torch.bfloat16)

    def bf16(i):
        w = ws[i]
        return torch.einsum("...gi,goi->...go", x, w.view(G, -1, inp)) if groups else torch.nn.functional.linear(x, w)

    def fp8(i, **cfg):
        return fl.fp8_gemm(x, packed[i][0], packed[i][1], scale_row, groups, **cfg)

    def us(fn):
        graph, _ = capture(fn, [i % n for i in range(args.calls)])
        return graph_us(graph, args.calls, args.reps, warmup=2)

    row = {"bf16": us(bf16), "fp8": us(fp8)}
    if args.sweep:
        row["sweep"] = fastest(SWEEP, lambda cfg: fp8(0, **cfg), lambda cfg: us(lambda i: fp8(i, **cfg)), fp8(0))
    row["gbs"] = {k: out * inp * b / row[k] / 1e3 for k, b in (("bf16", 2), ("fp8", 1))}
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=["tiny", "1b"], default="1b")
    ap.add_argument("--batch", type=int, default=64, help="decode tokens")
    ap.add_argument("--calls", type=int, default=64, help="calls captured per CUDA graph")
    ap.add_argument("--reps", type=int, default=20, help="timed graph replays")
    ap.add_argument("--sweep", action="store_true", help="also sweep the kernel's tile sizes")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth probe")
    args = ap.parse_args(argv)
    require_kernels("fp8_linear.py", fl)
    bw = copy_bandwidth("cuda", args.copy_mib)
    shapes = fp8_shapes(bench_config(args.config))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.1f} GB/s; config {args.config}, batch "
          f"{args.batch}; {sum(shapes.values())} fp8 linears in {len(shapes)} shapes")
    total = Counter()
    for (out, inp, groups), count in sorted(shapes.items()):
        row = time_shape(args, out, inp, groups)
        best = row["sweep"][0] if args.sweep else (row["fp8"], {}, 0.0)
        total.update({"bf16": count * row["bf16"], "fp8": count * row["fp8"], "best": count * best[0]})
        cells = "  ".join(f"{k} {row[k]:6.2f} us {row['gbs'][k]:7.1f} GB/s {row['gbs'][k] * 1e9 / bw:6.1%}"
                          for k in ("bf16", "fp8"))
        print(f"  [{out:5d} x {inp:5d}] groups {groups} x{count:3d}: {cells}  fp8/bf16 {row['fp8'] / row['bf16']:.2f}")
        if args.sweep:
            for t, cfg, err in row["sweep"][:3]:
                print(f"      {t:6.2f} us {cfg} (max |diff to the default| {err:.3g})")
    print(f"step total over the model's fp8 linears: bf16 {total['bf16']:.1f} us, fp8 {total['fp8']:.1f} us "
          f"({total['fp8'] / total['bf16']:.2f}x)" + (f", fp8 at each shape's fastest {total['best']:.1f} us "
                                                      f"({total['best'] / total['bf16']:.2f}x)" if args.sweep else ""))


if __name__ == "__main__":
    main()
