"""The rest of mHC's "pre" stage at a decode step as one Triton kernel, registered as the custom op
`lockstep::hc_pre_step`: from the projection's split-K partials (hc_projection_triton.py) to the
block input and the coefficients the combine needs.

What, per token t (hyper_connection.py has the formulas):
    mixes  = (sum over splits of the partial products) * rsqrt(sum of squares / K + eps)
    pre    = sigmoid(s0 * m_pre + b_pre) + hc_eps,  post = 2 * sigmoid(s1 * m_post + b_post)
    comb   = Sinkhorn(softmax_rows(s2 * m_comb + b_comb) + hc_eps)
    x_in   = sum_i pre_i X_i   (rounded once to the streams' dtype)
one program per token. Its coefficients are scalars (every lane computes them; there are 24), the
Sinkhorn is sinkhorn_triton.py's own per-entry normalisation, and the collapse reads the token's
n x D streams once.

Why: in the compiled decode step (1b config, batch 64, one H200, 2026-12-03, `--step-trace`) the
same work after the partials kernel was ~9 launches per mHC call, twice per layer (inductor's
split sums, the sigmoid and softmax kernels, the collapse, then the Sinkhorn kernel): ~16-21 us of
~2 us kernels each time, ~300 us of a 1.7 ms step. A decode step is latency-bound; the arithmetic
here is a few thousand flops a token.

Numerics: the same formulas in fp32; the splits are added in a tree (tl.sum), not torch's order,
and the softmax's divisions are correctly rounded (sinkhorn_triton's `_divide`); exp and sigmoid
are Triton's. So the coefficients equal the torch chain's to fp32 rounding and the block input to
a bf16 ulp, not bitwise (tests/models/test_hc_pre_triton.py). The Sinkhorn steps are the fused
Sinkhorn kernel's, bit for bit on the same input. A token's results depend on its own row only.

Where: hyper_connection.HyperConnection at a decode step on CUDA without gradients, with the
triton_hc switch (the projection kernel's conditions) and not over whole rows (whole_rows.py keeps
its in-order sums). Forward only. Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt
from . import sinkhorn_triton

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_D = 512  # elements of a stream per iteration of the collapse


def available(streams: torch.Tensor) -> bool:
    """The kernel can take streams [..., n, D]: Triton present, n within the unrolled Sinkhorn's
    limit, float streams."""
    return (triton is not None and streams.dim() >= 2 and 1 <= streams.shape[-2] <= sinkhorn_triton.MAX_N
            and streams.dtype in (torch.bfloat16, torch.float16, torch.float32))


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _bf16, _normalise = _gt._bf16, sinkhorn_triton._normalise
    _reciprocal, _divide = sinkhorn_triton._reciprocal, sinkhorn_triton._divide

    @triton.jit
    def _mix(p_row, j, rs, s_ok, stride_ps, r):
        """Mix j of the token: its partial products summed over the splits, times 1 / rms."""
        return tl.sum(tl.load(p_row + rs * stride_ps + j, mask=s_ok, other=0.0), axis=0) * r

    @triton.jit
    def _softmax_row(z, eps, N: tl.constexpr):
        """softmax over the N scalars of tuple z, + eps, each quotient correctly rounded."""
        m = z[0]
        for b in tl.static_range(1, N):
            m = tl.maximum(m, z[b])
        e = ()
        for b in tl.static_range(N):
            e = e + (tl.exp(z[b] - m),)
        total = e[0]
        for b in tl.static_range(1, N):
            total = total + e[b]
        y = _reciprocal(total)
        out = ()
        for b in tl.static_range(N):
            out = out + (_divide(e[b], total, y) + eps,)
        return out

    @triton.jit
    def _hc_pre_kernel(p_ptr, x_ptr, base_ptr, scale_ptr, out_ptr, post_ptr, comb_ptr,
                       S, K, D, iters, hc_eps, norm_eps,
                       stride_ps, stride_pt, stride_xt, stride_xn, stride_xd,
                       N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
                       INTERPRETED: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        # inductor passes Python floats as fp64 scalars; the torch chain computes in fp32
        hc_eps = tl.cast(hc_eps, tl.float32)
        norm_eps = tl.cast(norm_eps, tl.float32)
        rs = tl.arange(0, BLOCK_S)
        s_ok = rs < S
        p_row = p_ptr + t * stride_pt
        J: tl.constexpr = (2 + N) * N
        ss = tl.sum(tl.load(p_row + rs * stride_ps + J, mask=s_ok, other=0.0), axis=0)
        r = _reciprocal(tl.sqrt_rn(ss / K + norm_eps))
        s_pre = tl.load(scale_ptr).to(tl.float32)
        s_post = tl.load(scale_ptr + 1).to(tl.float32)
        s_comb = tl.load(scale_ptr + 2).to(tl.float32)
        pre = ()
        for i in tl.static_range(N):
            z = _mix(p_row, i, rs, s_ok, stride_ps, r) * s_pre + tl.load(base_ptr + i).to(tl.float32)
            pre = pre + (tl.sigmoid(z) + hc_eps,)
            z = _mix(p_row, N + i, rs, s_ok, stride_ps, r) * s_post + tl.load(base_ptr + N + i).to(tl.float32)
            tl.store(post_ptr + t * N + i, 2.0 * tl.sigmoid(z))
        comb = ()
        for a in tl.static_range(N):
            z = ()
            for b in tl.static_range(N):
                j = 2 * N + a * N + b
                z = z + (_mix(p_row, j, rs, s_ok, stride_ps, r) * s_comb + tl.load(base_ptr + j).to(tl.float32),)
            comb = comb + _softmax_row(z, hc_eps, N)
        # sinkhorn.py's steps: columns first, then (rows, columns) iters - 1 times
        comb = _normalise(comb, N, 1, N, hc_eps)
        for _ in range(iters - 1):
            comb = _normalise(comb, N, N, 1, hc_eps)
            comb = _normalise(comb, N, 1, N, hc_eps)
        for k in tl.static_range(N * N):
            tl.store(comb_ptr + t * N * N + k, comb[k])
        x_row = x_ptr + t * stride_xt
        for d0 in range(0, D, BLOCK_D):
            rd = d0 + tl.arange(0, BLOCK_D)
            d_ok = rd < D
            acc = pre[0] * tl.load(x_row + rd * stride_xd, mask=d_ok, other=0.0).to(tl.float32)
            for i in tl.static_range(1, N):
                acc += pre[i] * tl.load(x_row + i * stride_xn + rd * stride_xd, mask=d_ok, other=0.0).to(tl.float32)
            if BF16:
                tl.store(out_ptr + t * D + rd, _bf16(acc, INTERPRETED), mask=d_ok)
            else:
                tl.store(out_ptr + t * D + rd, acc.to(out_ptr.dtype.element_ty), mask=d_ok)

    @torch.library.triton_op("lockstep::hc_pre_step", mutates_args=())
    def hc_pre_step(partials: torch.Tensor, streams: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """partials [S, T, J + 1] (hc_projection_triton.hc_mix_partials of the flattened streams),
        streams [T, n, D], base [J], scale [3] -> (block input [T, D] in the streams' dtype,
        post [T, n] fp32, comb [T, n, n] fp32)."""
        T, n, D = streams.shape
        partials = partials.contiguous()  # the kernel steps along a row's mixes by 1
        out = streams.new_empty(T, D)
        post = streams.new_empty(T, n, dtype=torch.float32)
        comb = streams.new_empty(T, n, n, dtype=torch.float32)
        if T:
            torch.library.wrap_triton(_hc_pre_kernel)[(T,)](
                partials, streams, base, scale, out, post, comb, partials.shape[0], n * D, D, iters, hc_eps,
                norm_eps, partials.stride(0), partials.stride(1), *streams.stride(), N=n,
                BLOCK_S=triton.next_power_of_2(partials.shape[0]), BLOCK_D=min(BLOCK_D, triton.next_power_of_2(D)),
                BF16=streams.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(), num_warps=1)
        return out, post, comb

    # shapes for torch.compile's tracing, written out (step_attention_triton.py says why)
    @hc_pre_step.register_fake
    def _(partials, streams, base, scale, iters, hc_eps, norm_eps):
        T, n, D = streams.shape
        return (streams.new_empty(T, D), streams.new_empty(T, n, dtype=torch.float32),
                streams.new_empty(T, n, n, dtype=torch.float32))
