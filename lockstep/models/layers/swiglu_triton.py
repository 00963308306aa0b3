"""The routed experts' clamped SwiGLU (moe.swiglu_clamped) for the trainer, one Triton kernel each way.

    out = silu(min(gate, limit)) * clamp(up, -limit, limit)      h = [gate | up]  [N, 2F] -> [N, F]

Eagerly, on the grouped GEMM's [N, 2F] output, that is two clamps, the silu and the product
forward, and backward their four gradients plus the cat that joins d gate and d up (the chunk's
backward): ~10 passes over [N, F]-sized bf16 tensors, 98,304 x 512 per layer on the 1b config at
8 x 2048 tokens. Here the forward reads h once and writes out with the eager ops' roundings
(grouped_gemm_triton._swiglu_clamped, which the decode kernels share: the same bits), the backward
reads h and d out once and writes d h, in fp32 from the forward's bf16 values:

    d up   = g silu                     where -limit <= up <= limit, else 0
    d gate = g up_c s (1 + gate_c (1 - s))   where gate <= limit, else 0       s = sigmoid(gate_c)

the eager autograd's terms without its intermediate bf16 roundings (so equal to them to bf16
rounding, not bitwise).
"""

from __future__ import annotations

import torch

from lockstep.triton_support import trainer_kernel_takes

from . import grouped_gemm_triton as _gt
from .kernel_switch import grad_wanted

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK = 1024


def applies(h: torch.Tensor) -> bool:
    """Where moe.Experts.mlp takes it: Triton present, bf16 on CUDA, a gradient wanted (the trainer),
    eager (a compiled caller fuses the ops itself). The tests run the kernels under the interpreter."""
    return (triton is not None and trainer_kernel_takes(h, None) and grad_wanted(h)
            and not torch.compiler.is_compiling())


def swiglu_clamped(h: torch.Tensor, limit: float) -> torch.Tensor:
    """h [N, 2F] (gate columns, then up) -> [N, F]."""
    return SwigluClamped.apply(h, float(limit))


class SwigluClamped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, limit: float) -> torch.Tensor:
        h = h.contiguous()
        N, F2 = h.shape
        out = h.new_empty(N, F2 // 2)
        if out.numel():
            _forward_kernel[(N, triton.cdiv(F2 // 2, BLOCK))](h, out, limit, F2 // 2, ROUND=h.dtype == torch.bfloat16,
                                                              INTERPRETED=_gt.interpreted(), BLOCK=BLOCK)
        ctx.save_for_backward(h)
        ctx.limit = limit
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (h,) = ctx.saved_tensors
        N, F2 = h.shape
        d_h = torch.empty_like(h)
        if d_h.numel():
            _backward_kernel[(N, triton.cdiv(F2 // 2, BLOCK))](h, grad.contiguous(), d_h, ctx.limit, F2 // 2,
                                                               ROUND=h.dtype == torch.bfloat16,
                                                               INTERPRETED=_gt.interpreted(), BLOCK=BLOCK)
        return d_h, None


if triton is not None:
    _bf16, _swiglu = _gt._bf16, _gt._swiglu_clamped

    @triton.jit
    def _gate_up_tile(h_ptr, F, BLOCK: tl.constexpr):
        """This program's row, its BLOCK columns of F (and which exist), their gate and up values in fp32."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < F
        gate = tl.load(h_ptr + row * 2 * F + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * F + F + cols, mask=ok, other=0.0).to(tl.float32)
        return row, cols, ok, gate, up

    @triton.jit
    def _forward_kernel(h_ptr, out_ptr, limit, F, ROUND: tl.constexpr, INTERPRETED: tl.constexpr,
                        BLOCK: tl.constexpr):
        row, cols, ok, gate, up = _gate_up_tile(h_ptr, F, BLOCK)
        if ROUND:
            out = _swiglu(gate, up, limit, INTERPRETED)
        else:  # fp32 (the interpreter's tests): the same formula, no roundings
            gate_c = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
            up_c = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                              propagate_nan=tl.PropagateNan.ALL)
            out = gate_c / (1.0 + tl.exp(-gate_c)) * up_c
        tl.store(out_ptr + row * F + cols, out, mask=ok)

    @triton.jit
    def _backward_kernel(h_ptr, g_ptr, dh_ptr, limit, F, ROUND: tl.constexpr, INTERPRETED: tl.constexpr,
                         BLOCK: tl.constexpr):
        row, cols, ok, gate, up = _gate_up_tile(h_ptr, F, BLOCK)
        g = tl.load(g_ptr + row * F + cols, mask=ok, other=0.0).to(tl.float32)
        lim = limit
        if ROUND:  # torch's bf16 clamp compares with the bound rounded to bf16
            lim = _bf16(tl.cast(limit, tl.float32), INTERPRETED).to(tl.float32)
        gate_c = tl.minimum(gate, lim)
        up_c = tl.minimum(tl.maximum(up, -lim), lim)
        s = 1.0 / (1.0 + tl.exp(-gate_c))
        silu = gate_c * s
        if ROUND:  # the forward's bf16 silu, which the eager product saw
            silu = _bf16(silu, INTERPRETED).to(tl.float32)
        d_up = tl.where((up >= -lim) & (up <= lim), g * silu, 0.0)
        d_gate = tl.where(gate <= lim, g * up_c * s * (1.0 + gate_c * (1.0 - s)), 0.0)
        if ROUND:
            d_up, d_gate = _bf16(d_up, INTERPRETED), _bf16(d_gate, INTERPRETED)
        tl.store(dh_ptr + row * 2 * F + cols, d_gate, mask=ok)
        tl.store(dh_ptr + row * 2 * F + F + cols, d_up, mask=ok)
