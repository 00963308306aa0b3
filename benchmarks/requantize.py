"""The weight push's re-quantisation: fp8 e4m3 (128 x 128 blocks) and fp4 e2m1 (1 x 32 blocks), e8m0
scales, of a model's bf16 weights, through the calls an fp8 / fp8-fp4 engine's push makes
(quant/fp8.py quantize_fp8_blocks_into, quant/fp4.py quantize_fp4_blocks_into: the Triton kernels of
fp8_triton.py / fp4_triton.py on CUDA, the PyTorch rule elsewhere).

    python benchmarks/requantize.py --config gpu-848m                  # on a GPU
    python benchmarks/requantize.py --config cpu-tiny --device cpu

The weights: every bf16 matrix (and stack of expert matrices) of the model whose rows are a multiple
of 32 values (fp4's block), embeddings aside. Per format: ms for one call (a push makes one; host time included),
ms a call over --calls calls back to back (each call's host preparation overlapping the previous
call's kernels), and `ratio FORMAT copy bound / call`: the time a copy at the device's copy
bandwidth (measured in the same run) would take to move the call's bytes (weights read, codes and
scales written), over the one call's time; 1.0 would be a call as fast as a copy of its bytes.
Then whether the codes and scales equal the CPU reference's (quantize_fp8_block / quantize_fp4_block
on the CPU) bitwise, on --check tensors spread over the list (the reference is slow).
"""

from __future__ import annotations

import argparse
import time

import torch

from grpo_step import _configs, make_model
from rollout_throughput import copy_bandwidth, sync

from lockstep.models.precision import cast_model
from lockstep.quant.fp4 import FP4_BLOCK, quantize_fp4_block, quantize_fp4_blocks_into
from lockstep.quant.fp8 import FP8_BLOCK, fp8_scale_shape, quantize_fp8_block, quantize_fp8_blocks_into

E8M0 = torch.float8_e8m0fnu


def weights(config: str, device: str) -> list[torch.Tensor]:
    model = cast_model(make_model(_configs()[config]), torch.bfloat16).to(device)
    return [p.detach() for name, p in model.named_parameters()
            if p.dim() >= 2 and p.dtype == torch.bfloat16 and p.shape[-1] % FP4_BLOCK == 0 and "embed" not in name]


def fp8_outputs(ws):
    return [(torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
             torch.empty(fp8_scale_shape(tuple(w.shape)), dtype=E8M0, device=w.device)) for w in ws]


def fp4_outputs(ws):
    return [(torch.empty(*w.shape[:-1], w.shape[-1] // 2, dtype=torch.uint8, device=w.device),
             torch.empty(*w.shape[:-1], -(-w.shape[-1] // FP4_BLOCK), dtype=E8M0, device=w.device)) for w in ws]


FORMATS = {  # name -> (outputs for the weights, the push's call, the CPU reference of one weight)
    "fp8": (fp8_outputs, lambda ws, outs: quantize_fp8_blocks_into(ws, outs, FP8_BLOCK, "ue8m0"),
            lambda w: quantize_fp8_block(w, FP8_BLOCK, "ue8m0", scale_dtype=E8M0)),
    "fp4": (fp4_outputs, lambda ws, outs: quantize_fp4_blocks_into(ws, outs, FP4_BLOCK),
            lambda w: quantize_fp4_block(w, FP4_BLOCK, scale_dtype=E8M0)),
}


def seconds(fn, device: str, calls: int = 1, reps: int = 5) -> float:
    """The fastest of `reps` timings of `calls` calls of fn back to back, per call."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def same_as_reference(ws, outs, reference, picks: list[int]) -> bool:
    for i in picks:
        codes, scales = reference(ws[i].cpu())
        if not (torch.equal(as_bytes(outs[i][0]).cpu(), as_bytes(codes))
                and torch.equal(as_bytes(outs[i][1]).cpu(), as_bytes(scales))):
            return False
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="gpu-848m", choices=sorted(_configs()))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--calls", type=int, default=10, help="calls back to back for the second figure")
    ap.add_argument("--check", type=int, default=6, help="tensors compared bitwise with the CPU reference")
    args = ap.parse_args(argv)
    ws = weights(args.config, args.device)
    if not ws:
        ap.error(f"--config {args.config}: no bf16 weight with rows of a multiple of {FP4_BLOCK} values")
    read = sum(w.numel() * w.element_size() for w in ws)
    bandwidth = copy_bandwidth(args.device, 256)  # bytes read + written per second
    print(f"{args.config}: {len(ws)} weights, {read / 1e6:.1f} MB bf16 on {args.device}; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written)")
    picks = sorted({round(i * (len(ws) - 1) / max(args.check - 1, 1)) for i in range(args.check)}) if args.check else []
    for fmt in args.formats:
        outputs, call, reference = FORMATS[fmt]
        outs = outputs(ws)
        written = sum(q.numel() * q.element_size() + s.numel() * s.element_size() for q, s in outs)
        one = seconds(lambda: call(ws, outs), args.device)
        many = seconds(lambda: call(ws, outs), args.device, calls=args.calls)
        bound = (read + written) / bandwidth
        same = same_as_reference(ws, outs, reference, picks)
        print(f"{fmt}: one call {one * 1e3:.3f} ms, {many * 1e3:.3f} ms a call over {args.calls} back to back; "
              f"{(read + written) / 1e6:.1f} MB moved, copy bound {bound * 1e3:.3f} ms")
        print(f"ratio {fmt} copy bound / call: {bound / one:.3f}")
        print(f"{fmt} bitwise the CPU reference on {len(picks)} of {len(ws)} weights: {same}")


if __name__ == "__main__":
    main()
