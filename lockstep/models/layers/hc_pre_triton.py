"""The rest of mHC's "pre" stage at a decode step as one Triton kernel, registered as the custom op
`lockstep::hc_pre_step`: from the projection's split-K partials (hc_projection_triton.py) to the
block input and the coefficients the combine needs.

What, per token t (hyper_connection.py has the formulas):
    mixes  = (sum over splits of the partial products) * rsqrt(sum of squares / K + eps)
    pre    = sigmoid(s0 * m_pre + b_pre) + hc_eps,  post = 2 * sigmoid(s1 * m_post + b_post)
    comb   = Sinkhorn(softmax_rows(s2 * m_comb + b_comb) + hc_eps)
    x_in   = sum_i pre_i X_i   (rounded once to the streams' dtype)
A grid of (tokens, 1 + D / BLOCK_D) one-warp programs: program (t, 0) computes token t's post [n]
and comb [n, n] as small tiles and runs the Sinkhorn; programs (t, c > 0) compute its pre and
collapse one block of the streams' columns each, beside it. The Sinkhorn (39 dependent
normalisations) is the long chain, so the collapse costs no time after it.

Why: a decode step is latency-bound (~400 kernels of 1-5 us at batch 64 on the 1b config) and this
is a few thousand flops a token. Measured on one H200 (2026-12-03): benchmarks/hc_pre.py, batch 64,
n 4 x 1024, the partials kernel and this one 11.5 us a call against 20.4 for the torch chain
compiled (the partials kernel, inductor's kernels, the fused Sinkhorn); in the 1b decode step
(`rollout_throughput.py --step-trace`) 38 fewer kernels and 61 us less device time per step (1,703
-> 1,642 us), this kernel 4.9-5.3 us a call (8.5 us as one program per token running the collapse
after the Sinkhorn).

Numerics: the same formulas in fp32; the splits are added in a tree (tl.sum), not torch's order,
and the softmax's divisions are correctly rounded (sinkhorn_triton's `_divide`); exp and sigmoid
are Triton's. So the coefficients equal the torch chain's to fp32 rounding and the block input to
a bf16 ulp, not bitwise (tests/models/test_hc_pre_triton.py). The Sinkhorn takes sinkhorn.py's
steps with sinkhorn_triton.py's correctly rounded division, each line's sum in a tree: the fused
Sinkhorn kernel's result to fp32 rounding. A token's results depend on its own row only.

Where: hyper_connection.HyperConnection at a decode step on CUDA without gradients, with the
triton_hc switch (the projection kernel's conditions) and not over whole rows (whole_rows.py keeps
its in-order sums). Forward only. Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt
from . import rms_norm_grad_triton, sinkhorn_triton

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_D = 256  # columns of the streams per collapse program


def available(streams: torch.Tensor) -> bool:
    """The kernel can take streams [..., n, D]: Triton present, float streams, n within the fused
    Sinkhorn's limit (sinkhorn_triton.MAX_N; the trainer's Sinkhorn for the same streams)."""
    return (triton is not None and streams.dim() >= 2 and 1 <= streams.shape[-2] <= sinkhorn_triton.MAX_N
            and streams.dtype in (torch.bfloat16, torch.float16, torch.float32))


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _bf16, _reciprocal, _divide = _gt._bf16, sinkhorn_triton._reciprocal, sinkhorn_triton._divide
    _normed_rows = rms_norm_grad_triton._normed_rows

    @triton.jit
    def _mixes(p_row, cols, ok, splits, s_ok, r):
        """The token's mixes at columns `cols` (masked by `ok`): their partial products summed over
        the splits, times 1 / rms. splits (the splits' offsets) and s_ok have cols' rank + 1 dims,
        the splits along the first (the axis summed)."""
        tile = tl.load(p_row + splits + tl.expand_dims(cols, 0), mask=s_ok & tl.expand_dims(ok, 0), other=0.0)
        return tl.sum(tile, axis=0) * r

    @triton.jit
    def _normalise(x, AXIS: tl.constexpr, eps):
        """x / (sum of x along AXIS + eps), each quotient correctly rounded (sinkhorn_triton's division)."""
        s = tl.expand_dims(tl.sum(x, axis=AXIS), AXIS) + eps
        return _divide(x, s, _reciprocal(s))

    @triton.jit
    def _coefficients(p_row, r, rs, s_ok, rn, n_ok, base_ptr, scale_ptr, post_ptr, comb_ptr, t, iters, hc_eps,
                      stride_ps, N: tl.constexpr):
        """post [N] and comb [N, N] of token t (stored), from its partials."""
        z = _mixes(p_row, N + rn, n_ok, rs[:, None] * stride_ps, s_ok[:, None], r)
        z = z * tl.load(scale_ptr + 1).to(tl.float32) + tl.load(base_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)
        post = 2.0 * tl.sigmoid(z)
        tl.store(post_ptr + t * N + rn, post, mask=n_ok)
        j = 2 * N + rn[:, None] * N + rn[None, :]
        ok = n_ok[:, None] & n_ok[None, :]
        z = _mixes(p_row, j, ok, rs[:, None, None] * stride_ps, s_ok[:, None, None], r)
        z = z * tl.load(scale_ptr + 2).to(tl.float32) + tl.load(base_ptr + j, mask=ok, other=0.0).to(tl.float32)
        z = tl.where(ok, z, float("-inf"))
        e = tl.exp(z - tl.max(z, axis=1)[:, None])  # padding: exp(-inf) = 0
        total = tl.sum(e, axis=1)[:, None]
        comb = tl.where(ok, _divide(e, total, _reciprocal(total)) + hc_eps, 0.0)  # padding adds nothing below
        # sinkhorn.py's steps: columns first (sums over rows), then (rows, columns) iters - 1 times
        comb = _normalise(comb, 0, hc_eps)
        for _ in range(iters - 1):
            comb = _normalise(comb, 1, hc_eps)
            comb = _normalise(comb, 0, hc_eps)
        tl.store(comb_ptr + t * N * N + rn[:, None] * N + rn[None, :], comb, mask=ok)

    @triton.jit
    def _hc_pre_kernel(p_ptr, x_ptr, base_ptr, scale_ptr, out_ptr, post_ptr, comb_ptr, w_ptr,
                       S, K, D, iters, hc_eps, norm_eps, block_eps,
                       stride_ps, stride_pt, stride_xt, stride_xn, stride_xd,
                       N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                       NORM: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """Program (t, 0): token t's post and comb. Program (t, c > 0): its pre, and the collapse of
        the streams' c-th block of BLOCK_D columns; with NORM one program, the whole row, then the
        block's RMSNorm (weight w, block_eps) of it. The Sinkhorn's chain of dependent steps is the
        long one; the collapse programs run beside it instead of after it."""
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        # inductor passes Python floats as fp64 scalars; the torch chain computes in fp32
        hc_eps = tl.cast(hc_eps, tl.float32)
        norm_eps = tl.cast(norm_eps, tl.float32)
        rs = tl.arange(0, BLOCK_S)
        s_ok = rs < S
        rn = tl.arange(0, BLOCK_N)
        n_ok = rn < N
        p_row = p_ptr + t * stride_pt
        J: tl.constexpr = (2 + N) * N
        ss = tl.sum(tl.load(p_row + rs * stride_ps + J, mask=s_ok, other=0.0), axis=0)
        r = _reciprocal(tl.sqrt_rn(ss / K + norm_eps))
        if c == 0:
            _coefficients(p_row, r, rs, s_ok, rn, n_ok, base_ptr, scale_ptr, post_ptr, comb_ptr, t, iters, hc_eps,
                          stride_ps, N)
        else:
            z = _mixes(p_row, rn, n_ok, rs[:, None] * stride_ps, s_ok[:, None], r)
            z = z * tl.load(scale_ptr).to(tl.float32) + tl.load(base_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            pre = tl.sigmoid(z) + hc_eps
            rd = (c - 1) * BLOCK_D + tl.arange(0, BLOCK_D)
            d_ok = rd < D
            x = tl.load(x_ptr + t * stride_xt + rn[:, None] * stride_xn + rd[None, :] * stride_xd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            acc = tl.sum(pre[:, None] * x, axis=0)
            if NORM:  # the collapse rounded to bf16 (as the block input), then the norm (RMSNorm's), rounded
                w = tl.load(w_ptr + rd, mask=d_ok, other=0.0).to(tl.float32)
                row = _bf16(acc, INTERPRETED).to(tl.float32)[None, :]
                acc = tl.reshape(_normed_rows(row, w, D, tl.cast(block_eps, tl.float32), True), (BLOCK_D,))
            if BF16:
                tl.store(out_ptr + t * D + rd, _bf16(acc, INTERPRETED), mask=d_ok)
            else:
                tl.store(out_ptr + t * D + rd, acc.to(out_ptr.dtype.element_ty), mask=d_ok)

    @torch.library.triton_op("lockstep::hc_pre_step", mutates_args=())
    def hc_pre_step(partials: torch.Tensor, streams: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    iters: int, hc_eps: float, norm_eps: float, norm_weight: torch.Tensor | None = None,
                    block_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """partials [S, T, J + 1] (hc_projection_triton.hc_mix_partials of the flattened streams),
        streams [T, n, D], base [J], scale [3] -> (block input [T, D] in the streams' dtype,
        post [T, n] fp32, comb [T, n, n] fp32). With norm_weight [D] (bf16 streams): the block input
        after the block's RMSNorm (that weight, eps block_eps), one program a token doing both."""
        T, n, D = streams.shape
        partials = partials.contiguous()  # the kernel steps along a row's mixes by 1
        out = streams.new_empty(T, D)
        post = streams.new_empty(T, n, dtype=torch.float32)
        comb = streams.new_empty(T, n, n, dtype=torch.float32)
        norm = norm_weight is not None
        assert not norm or streams.dtype == torch.bfloat16, "the normed block input is bf16 streams' only"
        if T:  # with the norm, a token's whole row in one program
            block_d = triton.next_power_of_2(D) if norm else min(BLOCK_D, triton.next_power_of_2(D))
            torch.library.wrap_triton(_hc_pre_kernel)[(T, 1 + triton.cdiv(D, block_d))](
                partials, streams, base, scale, out, post, comb, norm_weight if norm else base,
                partials.shape[0], n * D, D, iters, hc_eps, norm_eps, block_eps, partials.stride(0), partials.stride(1),
                *streams.stride(), N=n, BLOCK_N=triton.next_power_of_2(n),
                BLOCK_S=triton.next_power_of_2(partials.shape[0]), BLOCK_D=block_d, NORM=norm,
                BF16=streams.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(), num_warps=1)
        return out, post, comb

    # shapes for torch.compile's tracing, written out (step_attention_triton.py says why)
    @hc_pre_step.register_fake
    def _(partials, streams, base, scale, iters, hc_eps, norm_eps, norm_weight=None, block_eps=0.0):
        T, n, D = streams.shape
        return (streams.new_empty(T, D), streams.new_empty(T, n, dtype=torch.float32),
                streams.new_empty(T, n, n, dtype=torch.float32))
