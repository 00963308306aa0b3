"""fp32 operands as three bf16 parts ("bf16x3"): fp32-accurate products on bf16 tensor cores.

An fp32 value t is exactly hi + mid + lo with each part a bf16 (8 significant bits each, 24 in
all: fp32's): hi = bf16(t); t - hi is exact in fp32 and has at most 16 significant bits, so
mid = bf16(t - hi) leaves a remainder of at most 8, which lo holds exactly (bf16 has fp32's
exponent range; only values near the smallest normals could lose bits). A bf16 operand times
each part is exact in fp32, so one bf16 GEMM with fp32 accumulation over the three parts sums
the same terms as the fp32 GEMM of the upcast operands (up to summation order), reading the
bf16 operand as it is: no fp32 copy of it, no CUDA-core sgemm. It pays 3x the FLOPs of the
product, so it is for products with a small side (mHC's projection: 24 columns).
"""

from __future__ import annotations

import torch

from .fp32_logits import mm_fp32_out


def bf16x3(t: torch.Tensor) -> torch.Tensor:
    """t (fp32) -> [3, *t.shape] bf16 parts (hi, mid, lo) with hi + mid + lo == t."""
    t = t.float()
    hi = t.to(torch.bfloat16)
    rest = t - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)])


def mm_bf16_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] (bf16) @ b [K, N] (fp32) -> fp32 [M, N], as one bf16 GEMM over b's three parts."""
    parts = bf16x3(b)  # [3, K, N]
    out = mm_fp32_out(a, parts.permute(1, 0, 2).reshape(b.shape[0], 3 * b.shape[1]))  # [M, 3N]
    return out.view(a.shape[0], 3, b.shape[1]).sum(1)


def mm_fp32_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] (fp32) @ b [K, N] (bf16) -> fp32 [M, N], as one bf16 GEMM over a's three parts."""
    parts = bf16x3(a)  # [3, M, K]
    return mm_fp32_out(parts.reshape(3 * a.shape[0], a.shape[1]), b).view(3, a.shape[0], b.shape[1]).sum(0)
