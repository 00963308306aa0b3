"""Straight-through fake quantisation for quantisation-aware training.

Forward: y = dequant(quant(w)) in w's dtype, i.e. exactly the weights the serving engine will
multiply by. Backward: dL/dw = dL/dy (the straight-through estimator: rounding is treated as the
identity). This is an autograd.Function rather than `w + (dq - w).detach()`: in bf16 that
addition rounds, so its forward would not equal dq bit for bit.
"""

from __future__ import annotations

import torch

from lockstep.quant.fp4 import FP4_BLOCK, dequantize_fp4_block, quantize_fp4_block
from lockstep.quant.fp8 import FP8_BLOCK, dequantize_fp8_block, quantize_fp8_block

__all__ = ["fake_quant_fp8", "fake_quant_fp4"]


class _FakeQuantFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, block, scale_fmt):
        q, s = quantize_fp8_block(w.detach(), block, scale_fmt)
        return dequantize_fp8_block(q, s, w.dtype, block=block)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None, None


class _FakeQuantFP4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, block):
        packed, s = quantize_fp4_block(w.detach(), block)
        return dequantize_fp4_block(packed, s, w.dtype, block=block)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None


def fake_quant_fp8(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """dequant(quant_fp8(w)) in w.dtype; gradient passes straight through."""
    return _FakeQuantFP8.apply(w, tuple(block), scale_fmt)


def fake_quant_fp4(w: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """dequant(quant_fp4(w)) in w.dtype; gradient passes straight through."""
    return _FakeQuantFP4.apply(w, block)
