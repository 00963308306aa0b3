"""RMSNorm, weighted and unweighted.

The reduction runs in fp32 whatever the activation dtype, and the weight (kept in fp32, as
DeepSeek ships it) multiplies before the single cast back, so bf16 and fp32 runs differ only
by that final rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from . import rms_norm_grad_triton
from .fixed_order_rmsnorm import fixed_order_rms_norm
from .kernel_switch import Switched
from .whole_rows import in_whole_rows


def rms_norm(x: torch.Tensor, eps: float, triton: bool | None = False) -> torch.Tensor:
    """Unweighted RMSNorm over the last dim, computed in fp32, returned in x's dtype. triton: the
    caller's `triton_norm` switch (rms_norm_grad_triton.py: the trainer's kernels)."""
    if in_whole_rows():  # the same formula with the sum of squares in a fixed order (whole_rows.py)
        return fixed_order_rms_norm(x, None, eps)
    if rms_norm_grad_triton.applies(x, None, triton):
        return rms_norm_grad_triton.trained_rms_norm(x, None, eps)
    xf = x.float()
    return (xf * inverse_rms(xf, eps)).to(x.dtype)


def inverse_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms over the last dim of fp32 xf, [..., 1]: the factor `rms_norm` scales by."""
    return torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def inverse_rms_one_pass(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`inverse_rms` of x in any dtype, summed in fp32, as one reduction over x (no fp32 copy of
    x, no squared copy): the same value up to fp32 rounding (the norm is squared back), not the
    same bits. For callers that never materialise the normalised x (hyper_connection.ScaledProjection)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return torch.rsqrt(norm * norm / x.shape[-1] + eps)


class RMSNorm(Switched, nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if in_whole_rows():
            return fixed_order_rms_norm(x, self.weight, self.eps)
        if rms_norm_grad_triton.applies(x, self.weight, self.kernels.on("triton_norm")):
            return rms_norm_grad_triton.trained_rms_norm(x, self.weight, self.eps)
        xf = x.float()
        return (self.weight.float() * (xf * inverse_rms(xf, self.eps))).to(x.dtype)
