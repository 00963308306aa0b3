"""A batch-invariant RMSNorm as a Triton kernel registered as the custom op
`lockstep::fixed_order_rms_norm` (issue 16, item 2: fixed-order kernels on the policy path).

What is invariant, and why: one program per row; the row's sum of squares accumulates in fp32
in BLOCK-wide tiles walked in index order (lane i of the accumulator takes columns i, i + BLOCK,
...), then the BLOCK lanes are summed by one fixed tree (tl.sum). BLOCK and the warps come from
the row length D only (`launch_config`), so a row's result is the same bits whatever M, the
other rows (garbage padding included) and its position. M is the grid, not a kernel argument.

Numerics, as norm.py's RMSNorm / rms_norm compute them (module docstring there): x to fp32;
ms = sum(x^2) / D, a correctly rounded division (torch's CPU mean: sum then divide; its CUDA mean
multiplies by an fp32 1/D instead, at most 1 fp32 ulp apart); r = rsqrt(ms + eps) with eps in
fp32; y = x * r; weighted: w.float() * y; the one rounding to x's dtype at the end (bf16: nearest
even). Only the order of the sum of squares differs from eager (torch's vectorised / cascade
sum): outputs agree to 1 ulp of x's dtype, bitwise where the sum of squares is exact (the tests).
rsqrt: libdevice's rsqrtf on GPUs (torch's CUDA rsqrt calls CUDA's rsqrtf; on an H200 the bf16
outputs equal eager's on exact sums, fp32 ones within a few ulps, from the mean), numpy's
1 / sqrt under the interpreter (what torch's CPU rsqrt computes: equal on CPU). A GPU compiler
may fuse x * x + acc into an FMA: a fixed choice per compiled kernel, so invariance holds; it may
move the sum an ulp.

`fixed_order_rms_norm(x, weight, eps)` takes the kernel where it runs (CUDA, or the interpreter)
and the reference elsewhere or when a gradient is wanted (forward only, no autograd registered).
The true-on-policy forward's norms call it over whole rows (norm.py).

On an H200 (1b config): a decode step's 50 of them take ~92 us (~1.8 us each, one program per
row); bf16 outputs equal eager CUDA's on exact sums, fp32 ones within 4 ulps (the mean, above);
the engine's and the trainer's bits agree (tests/test_true_on_policy.py on CUDA). Under the
interpreter one program per row is the cost: ~10 ms each on a 2-core machine, most of the
whole-rows CPU tests' time.
"""

from __future__ import annotations

import torch

from lockstep.triton_support import interpreted

from . import grouped_gemm_triton as _gt
from .fixed_order_linear import DTYPES

triton = _gt.triton
if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """norm.py's RMSNorm.forward (weight given) or rms_norm (None), written out."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y if weight is None else weight.float() * y).to(x.dtype)


def kernel_applies(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Triton present, CUDA (or the interpreter), bf16 or fp32 x, no gradient wanted."""
    if triton is None or x.dtype not in DTYPES:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return False
    return x.is_cuda or interpreted()


def fixed_order_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dim [..., D] (weight [D] or None): the kernel where it applies, else the reference."""
    if not kernel_applies(x, weight):
        return rms_norm_reference(x, weight, eps)
    return torch.ops.lockstep.fixed_order_rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def launch_config(D: int) -> dict:
    """By the row length only: tiles of up to 1024 columns (7 for a 7168-wide row), 4 warps. Not tuned."""
    return dict(BLOCK=min(1024, max(16, triton.next_power_of_2(D))), num_warps=4)


if triton is not None:
    _bf16 = _gt._bf16  # by name: torch.compile's compile worker cannot resolve a module alias

    @triton.jit
    def _row_inverse_rms(x_row, stride_xd, D, d_float, eps, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """rsqrt(sum over BLOCK tiles in index order of x^2 / D + eps) of one row, in fp32: the
        forward's r, and the backward's (rms_norm_grad_triton.py) recomputed with the same bits."""
        # a no-op launched eagerly (Triton types a Python float fp32); inside a compiled graph inductor
        # passes floats as fp64 scalars, which would carry the sum into fp64
        d_float, eps = tl.cast(d_float, tl.float32), tl.cast(eps, tl.float32)
        cols = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK):
            v = tl.load(x_row + (d0 + cols) * stride_xd, mask=d0 + cols < D, other=0.0).to(tl.float32)
            acc += v * v
        ms = tl.math.div_rn(tl.sum(acc, axis=0), d_float)
        if INTERPRETED:  # which has no libdevice
            r = tl.math.rsqrt(ms + eps)
        else:
            r = libdevice.rsqrt(ms + eps)
        return r

    @triton.jit
    def _fixed_order_rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, d_float, eps, stride_xm, stride_xd,
                                     stride_om, stride_od, HAS_WEIGHT: tl.constexpr, BF16: tl.constexpr,
                                     INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """out[m] = (w *) x[m] * rsqrt(sum over BLOCK tiles in index order of x[m]^2 / D + eps)."""
        # a no-op launched eagerly (Triton types a Python float fp32); inside a compiled graph inductor
        # passes floats as fp64 scalars, which would carry the sum into fp64
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xm
        out_row = out_ptr + row * stride_om
        cols = tl.arange(0, BLOCK)
        r = _row_inverse_rms(x_row, stride_xd, D, d_float, eps, INTERPRETED, BLOCK)
        for d0 in range(0, D, BLOCK):
            ok = d0 + cols < D
            y = tl.load(x_row + (d0 + cols) * stride_xd, mask=ok, other=0.0).to(tl.float32) * r
            if HAS_WEIGHT:
                y = tl.load(w_ptr + d0 + cols, mask=ok, other=0.0).to(tl.float32) * y
            if BF16:
                y = _bf16(y, INTERPRETED)
            tl.store(out_row + (d0 + cols) * stride_od, y, mask=ok)

    @torch.library.triton_op("lockstep::fixed_order_rms_norm", mutates_args=())
    def _fixed_order_rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                                 block: int = 0) -> torch.Tensor:
        """x [M, D] bf16 or fp32, weight [D] contiguous (any float dtype) or None -> [M, D] in x's
        dtype. A nonzero block overrides `launch_config` (the same on every path, or rows differ)."""
        M, D = x.shape
        cfg = launch_config(D)
        if block:
            cfg["BLOCK"] = block
        out = x.new_empty(M, D)
        if M == 0:
            return out
        torch.library.wrap_triton(_fixed_order_rms_norm_kernel)[(M,)](
            x, x if weight is None else weight.contiguous(), out, D, float(D), eps, *x.stride(), *out.stride(),
            HAS_WEIGHT=weight is not None, BF16=x.dtype == torch.bfloat16, INTERPRETED=interpreted(), **cfg)
        return out

    @_fixed_order_rms_norm_op.register_fake
    def _(x, weight, eps, *config):
        return x.new_empty(x.shape)
