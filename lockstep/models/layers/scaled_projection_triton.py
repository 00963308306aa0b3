"""The streams' gradient of mHC's normed projection (hyper_connection.ScaledProjection) as one
Triton kernel:

    d x = (g r) @ fn - s x (+ a)   g r [T, J] fp32, fn [J, D] fp32, s [T] fp32, x [T, D] bf16 -> bf16

Eagerly this is an fp32 GEMM writing a [T, D] fp32 product (J = 24 columns: cuBLAS runs it as a
thin, memory-bound sgemm) and an addcmul reading it back with x: on the 1b config at 8 x 2048
tokens (D = 4 x 1024) 0.15 + 0.34 ms per call, 16 calls a step (H200 profile). Here each program
multiplies a [rows, J] by [J, columns] tile on CUDA cores in fp32 (input_precision "ieee": no tf32)
and subtracts s x before the one rounding to bf16: x read once, d x written once. The same value to
fp32 rounding (the products summed in the kernel's order, not cuBLAS's). The addend a [T, D] (the
streams' gradient from their other consumers, handed through: hyper_connection.py) is added in
fp32 before that rounding, where autograd would add it in a pass of its own.
"""

from __future__ import annotations

import torch

from lockstep.triton_support import trainer_kernel_takes

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_M, BLOCK_D = 32, 128


def applies(x: torch.Tensor, fn: torch.Tensor) -> bool:
    """Triton present, bf16 streams on CUDA, at most 64 mixes. (The tests run `streams_grad` itself
    under the interpreter; the CPU trainer keeps the eager ops.)"""
    return triton is not None and trainer_kernel_takes(x, None) and fn.shape[0] <= 64


def streams_grad(gr: torch.Tensor, fn: torch.Tensor, s: torch.Tensor, flat: torch.Tensor,
                 addend: torch.Tensor | None = None) -> torch.Tensor:
    """gr [T, J] fp32, fn [J, D], s [T, 1] fp32, flat [T, D], addend [T, D] or None -> gr @ fn - s flat
    (+ addend), in flat's dtype."""
    T, D = flat.shape
    J = fn.shape[0]
    gr, fn, s, flat = gr.float().contiguous(), fn.float().contiguous(), s.float().reshape(T).contiguous(), flat.contiguous()
    out = torch.empty_like(flat)
    if out.numel():
        _streams_grad_kernel[(triton.cdiv(T, BLOCK_M), triton.cdiv(D, BLOCK_D))](
            gr, fn, s, flat, addend.reshape(T, D).contiguous() if addend is not None else flat, out, T, D, J=J,
            J_PAD=max(16, triton.next_power_of_2(J)), ADD=addend is not None, ROUND=flat.dtype == torch.bfloat16,
            INTERPRETED=_gt.interpreted(), BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D)
    return out


if triton is not None:
    _bf16 = _gt._bf16

    @triton.jit
    def _streams_grad_kernel(gr_ptr, fn_ptr, s_ptr, x_ptr, add_ptr, out_ptr, T, D, J: tl.constexpr,
                             J_PAD: tl.constexpr, ADD: tl.constexpr, ROUND: tl.constexpr, INTERPRETED: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        js = tl.arange(0, J_PAD)
        row_ok, col_ok = rows < T, cols < D
        rows64 = rows.to(tl.int64)
        gr = tl.load(gr_ptr + rows64[:, None] * J + js[None, :], mask=row_ok[:, None] & (js[None, :] < J), other=0.0)
        fn = tl.load(fn_ptr + js[:, None] * D + cols[None, :], mask=(js[:, None] < J) & col_ok[None, :], other=0.0)
        acc = tl.dot(gr, fn, input_precision="ieee")
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows64[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
        d_x = acc - s[:, None] * x
        if ADD:
            d_x += tl.load(add_ptr + rows64[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if ROUND:
            d_x = _bf16(d_x, INTERPRETED)
        tl.store(out_ptr + rows64[:, None] * D + cols[None, :], d_x, mask=ok)
