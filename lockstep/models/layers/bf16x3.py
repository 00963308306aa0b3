"""fp32 operands as three bf16 parts ("bf16x3"): fp32-accurate products on bf16 tensor cores.

An fp32 value t is exactly hi + mid + lo with each part a bf16 (8 significant bits each, 24 in
all: fp32's): hi = bf16(t); t - hi is exact in fp32 and has at most 16 significant bits, so
mid = bf16(t - hi) leaves a remainder of at most 8, which lo holds exactly (bf16 has fp32's
exponent range; only values near the smallest normals could lose bits). A bf16 operand times
each part is exact in fp32, so one bf16 GEMM with fp32 accumulation over the three parts sums
the same terms as the fp32 GEMM of the upcast operands (up to summation order), reading the
bf16 operand as it is: no fp32 copy of it, no CUDA-core sgemm. It pays 3x the FLOPs of the
product, so it is for products with a small side (mHC's projection: 24 columns).

The split of a matrix is one Triton kernel where the kernels run (CUDA, or the interpreter: the
CPU tests), writing the parts where the GEMM reads them; eager torch it was eight element-wise
kernels and a copy, twice per mHC projection in a train step (16 projections in the 1b config:
~270 small launches a step). Both forms give the same bits (bf16 rounding to nearest even; tested
under the interpreter and on an H100) away from fp32's subnormals, where the CPU's eager form and the
kernel were seen to differ.
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt
from .fp32_logits import mm_fp32_out

triton = _gt.triton
if triton is not None:
    import triton.language as tl

SPLIT_BLOCK = 1024  # values per program of the split kernel


def bf16x3(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """t (fp32) -> its bf16 parts (hi, mid, lo), hi + mid + lo == t, stacked at `dim`: 0 gives
    [3, *t.shape]; 1 of a matrix [rows, cols] gives [rows, 3, cols] (each row's parts side by side)."""
    if t.dim() == 2 and triton is not None and (t.is_cuda or _gt.interpreted()):
        return _split_kernel_call(t.float(), dim)
    t = t.float()
    hi = t.to(torch.bfloat16)
    rest = t - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)], dim=dim)


def _split_kernel_call(t: torch.Tensor, dim: int) -> torch.Tensor:
    rows, cols = t.shape
    if dim == 0:
        out = torch.empty(3, rows, cols, dtype=torch.bfloat16, device=t.device)
        row_step, part_step = cols, rows * cols
    elif dim == 1:
        out = torch.empty(rows, 3, cols, dtype=torch.bfloat16, device=t.device)
        row_step, part_step = 3 * cols, cols
    else:
        raise ValueError(f"bf16x3 stacks a matrix's parts at dim 0 or 1, not {dim}")
    if t.numel():
        _split_kernel[(-(-t.numel() // SPLIT_BLOCK),)](  # Python's ceil-division (triton.cdiv: ~4 us a call)
            t, out, rows * cols, cols, *t.stride(), row_step, part_step, INTERPRETED=_gt.interpreted(),
            BLOCK=SPLIT_BLOCK)
    return out


def mm_bf16_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] (bf16) @ b [K, N] (fp32) -> fp32 [M, N], as one bf16 GEMM over b's three parts."""
    parts = bf16x3(b, dim=1)  # [K, 3, N]: b's parts side by side, the GEMM's [K, 3N] operand
    out = mm_fp32_out(a, parts.view(b.shape[0], 3 * b.shape[1]))  # [M, 3N]
    return out.view(a.shape[0], 3, b.shape[1]).sum(1)


def mm_fp32_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] (fp32) @ b [K, N] (bf16) -> fp32 [M, N], as one bf16 GEMM over a's three parts."""
    parts = bf16x3(a)  # [3, M, K]
    return mm_fp32_out(parts.view(3 * a.shape[0], a.shape[1]), b).view(3, a.shape[0], b.shape[1]).sum(0)


if triton is not None:
    _bf16 = _gt._bf16  # by name: torch.compile's compile worker cannot resolve a module alias

    @triton.jit
    def _split_kernel(t_ptr, out_ptr, numel, cols, stride_r, stride_c, row_step, part_step,
                      INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """Values i of t [rows, cols] (any strides, in row-major order): hi, mid, lo at out + part *
        part_step + row * row_step + col, each rounded to nearest even as torch's cast does."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < numel
        row, col = i // cols, i % cols
        t = tl.load(t_ptr + row * stride_r + col * stride_c, mask=ok, other=0.0)
        hi = _bf16(t, INTERPRETED)
        rest = t - hi.to(tl.float32)
        mid = _bf16(rest, INTERPRETED)
        lo = _bf16(rest - mid.to(tl.float32), INTERPRETED)
        at = out_ptr + row * row_step + col
        tl.store(at, hi, mask=ok)
        tl.store(at + part_step, mid, mask=ok)
        tl.store(at + 2 * part_step, lo, mask=ok)
