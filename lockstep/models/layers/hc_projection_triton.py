"""mHC's projection with its RMSNorm as one Triton kernel, registered as the custom op
`lockstep::hc_mix_partials`, and `hc_mixes`, which finishes it in torch ops.

What: each mHC call projects its token's flattened streams x [T, K] (K = n * D) onto the
mixing coefficients, mixes = rms_norm(x) @ fn^T with fn [J, K] (J = (2 + n) * n = 24 in
HyperConnection, J = n = 4 in HyperHead). The norm's scale is one number per row, so it can come
after the products:
    mixes[t] = (x[t] @ fn^T) * rsqrt(sum_k x[t, k]^2 / K + eps)
The kernel computes, in one launch, split-K partial products and the partial sums of squares,
    partials[s, t, j] = sum_{k in split s} x[t, k] * fn[j, k]   (j < J)
    partials[s, t, J] = sum_{k in split s} x[t, k]^2
and `hc_mixes` adds the splits and scales (a few element-wise torch ops, which inductor fuses
into the element-wise kernels after it when compiled). Deterministic: no atomics.

Why: in a decode step (64 tokens) cuBLAS ran the fp32 projection as a SIMT sgemm plus a split-K
reduce kernel, after a separate reduction kernel for the norm: ~11 us per call, 16-17 calls per
step, for 6 MFLOP. This is pure latency: a grid of (cdiv(T, BLOCK_T), split) programs, 128 at
T = 64 and K = 4096 (4 tiles of 16 rows x 32 splits of 128), each reads a [BLOCK_T, K / split]
slice of x and the [J, K / split] slice of fn once and runs a short FMA chain.

Numerics: x (bf16, fp16 or fp32) and fn are converted to fp32 exactly in the kernel (no
separate `.float()` kernels); the products are fp32 FMAs (tl.dot on fp32 tiles with
input_precision="ieee": no TF32), accumulated along k within a split, then the splits added
by torch. The reference normalises first and rounds the normalised x before the GEMM, so the
two differ by fp32 rounding (relative ~1e-6 of sum_k |x_k fn_jk| / rms(x)), not bitwise.
The default launch config depends on J and K only and a row's sums do not involve the other
rows, so a row's partials do not depend on the batch; the second stage's sum over splits is
torch's (or inductor's) reduction.

`lockstep::hc_combine_partials` is the same kernel with the previous block's mHC combine in front
(X'_k = post_k y + sum_j comb[j, k] X_j, stream_mix_triton._combined_stream: eager's roundings):
each program makes its tile of the combined streams, writes it and goes on with it as x. At a decode
step that is the attention's combine, which inductor ran as a kernel of its own (1.5 us and ~0.4 us
idle a layer in the 1b step on one H200, 2026-12-04) between the attention and the MoE's mHC pre
(hyper_connection.HyperConnection.after).

Forward only (no autograd): callers take it with gradients off (hyper_connection._mixes). No
triton.autotune (it would benchmark during CUDA-graph capture): `launch_config` picks by shape,
keyword arguments override it (benchmarks/hc_projection.py). Testable on CPU with
TRITON_INTERPRET=1 (tests/models/test_hc_projection_triton.py).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt
from . import stream_mix_triton
from . import sum_splits_triton as _ss

triton = _gt.triton  # None without Triton: hyper_connection.py's torch expression is always there
if triton is not None:
    import triton.language as tl

MAX_J = 128  # output columns held by one program (padded to a power of two, at least 16)
# tl.dot's input precision for the fp32 tiles on a GPU: three tf32 tensor-core products per tile,
# within fp32 rounding of the "ieee" FMAs. One H200 (2026-12-03, benchmarks/hc_projection.py, J 24,
# K 4096, CUDA graphs): 3.4 us a call against 6.5 for "ieee" at 64 rows, 11.8 against 40.3 at 512;
# both 1.9e-6 from the fp32 reference at values up to 5.5.
PRECISION = "tf32x3"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(x: torch.Tensor, fn: torch.Tensor) -> bool:
    """The kernel can compute x [..., K] (rows flattened) @ fn [J, K]^T: Triton present, float
    inputs, K matching, 1 <= J <= MAX_J, at least one row."""
    return (triton is not None and x.dim() >= 1 and fn.dim() == 2 and x.shape[-1] == fn.shape[1]
            and x.dtype in _DTYPES and fn.dtype in _DTYPES and 1 <= fn.shape[0] <= MAX_J
            and x.numel() > 0)


def combines(n: int, D: int, fn: torch.Tensor) -> bool:
    """Whether hc_combine_partials can take streams [T, n, D] for fn: every tile of the default
    launch within one stream (D a multiple of its BLOCK_K)."""
    K = n * D
    return triton is not None and D % launch_config(fn.shape[0], K, default_split(K))["BLOCK_K"] == 0


def default_split(K: int) -> int:
    """Splits of K: ~128 of K per program (K = 4096: 32 splits), at most 32, by K only."""
    return max(1, min(32, K // 128))


def launch_config(J: int, K: int, split: int) -> dict:
    """BLOCK_T = 16 rows per program (tl.dot's minimum; a decode step has 64), BLOCK_K up to 64
    of the split's K; 4 warps, 2 pipeline stages (a split is a tile or two). By the weight's shape
    only, so that a row's result never depends on the batch: larger T makes more programs, each
    re-reading its slice of fn from L2 (--block-t in benchmarks/hc_projection.py for prefill)."""
    return dict(BLOCK_T=16, BLOCK_K=min(64, max(16, triton.next_power_of_2(triton.cdiv(K, split)))),
                num_warps=4, num_stages=2)


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _dot, _combined_stream = _gt._dot, stream_mix_triton._combined_stream

    @triton.jit
    def _partials_kernel(x_ptr, fn_ptr, out_ptr, T, J, K, k_per_split,
                         stride_xt, stride_xk, stride_fj, stride_fk, stride_os, stride_ot,
                         y_ptr, post_ptr, comb_ptr, new_ptr, D,
                         BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
                         N_HC: tl.constexpr):
        """out[s, t tile, :J] = x[t tile, split s] @ fn[:, split s]^T, out[s, t tile, J] = the
        rows' sums of squares over split s. k_per_split is a multiple of BLOCK_K; with EVEN_K,
        K is one too and no tile crosses K. N_HC > 0: x is first the mHC combine of the streams at
        x_ptr [T, N_HC, D] (contiguous; every BLOCK_K tile within one stream) with the block output y
        [T, D] and post / comb (hyper_connection.hc_combine), written to new_ptr as it is made."""
        s = tl.program_id(1)
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rj = tl.arange(0, BLOCK_J)
        rk = tl.arange(0, BLOCK_K)
        t_ok = rt < T
        j_ok = rj < J
        x_rows = x_ptr + rt[:, None].to(tl.int64) * stride_xt
        fn_rows = fn_ptr + rj[:, None] * stride_fj
        k_start = s * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        acc = tl.zeros((BLOCK_T, BLOCK_J), dtype=tl.float32)
        ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):  # no iteration in a split past K: zeros
            kk = k0 + rk
            if EVEN_K:
                a_mask = t_ok[:, None]
                b_mask = j_ok[:, None]
            else:
                k_ok = kk < K
                a_mask = t_ok[:, None] & k_ok[None, :]
                b_mask = j_ok[:, None] & k_ok[None, :]
            # converted to fp32 exactly; fp32 tiles also avoid the interpreter's broken bf16 dot.
            # fn is loaded as stored, [J, K] rows along k (coalesced), and transposed in registers:
            # read as [K, J] directly, neighbouring lanes were K * 4 bytes apart
            if N_HC > 0:  # this tile of the combined streams: stream k0 // D, its columns k0 % D ...
                cols = k0 % D + rk
                y = tl.load(y_ptr + rt[:, None].to(tl.int64) * D + cols[None, :], mask=a_mask, other=0.0)
                new = _combined_stream(y.to(tl.float32), k0 // D, rt.to(tl.int64), t_ok, cols, a_mask, x_ptr,
                                       post_ptr, comb_ptr, stride_xt, D, N_HC, INTERPRETED)
                tl.store(new_ptr + rt[:, None].to(tl.int64) * stride_xt + kk[None, :], new, mask=a_mask)
                a = new.to(tl.float32)
            else:
                a = tl.load(x_rows + kk[None, :] * stride_xk, mask=a_mask, other=0.0).to(tl.float32)
            b = tl.load(fn_rows + kk[None, :] * stride_fk, mask=b_mask, other=0.0).to(tl.float32)
            # the interpreter: products summed in index order (grouped_gemm_triton._dot says why). On a
            # GPU, PRECISION (module constant): "tf32x3" takes the tensor cores three times (a split of
            # each fp32 value in two tf32 halves), "ieee" fp32 FMAs. (Broadcast products summed by
            # tl.sum are no third way: Triton's compiler turns them into a tf32 tl.dot, ~5e-4 off.)
            if INTERPRETED:
                acc = _dot(a, tl.trans(b), acc, True)
            else:
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
            ss += tl.sum(a * a, axis=1)
        out_rows = out_ptr + s * stride_os + rt.to(tl.int64) * stride_ot
        tl.store(out_rows[:, None] + rj[None, :], acc, mask=t_ok[:, None] & j_ok[None, :])
        tl.store(out_rows + J, ss, mask=t_ok)

    @torch.library.triton_op("lockstep::hc_mix_partials", mutates_args=())
    def hc_mix_partials(x: torch.Tensor, fn: torch.Tensor, split: int, block_t: int = 0, block_k: int = 0,
                        num_warps: int = 0, num_stages: int = 0, precision: str = "") -> torch.Tensor:
        """x [T, K] (bf16, fp16 or fp32, any strides), fn [J, K] -> partials [split, T, J + 1]
        fp32: per split of K, the products x @ fn^T (columns < J) and the rows' sums of squares
        (column J). Nonzero keywords override `launch_config`, `precision` PRECISION (the
        benchmark's --precision)."""
        return launch_partials(x, fn, split, block_t, block_k, num_warps, num_stages, precision)

    def launch_partials(x: torch.Tensor, fn: torch.Tensor, split: int, block_t: int = 0, block_k: int = 0,
                        num_warps: int = 0, num_stages: int = 0, precision: str = "",
                        combine: tuple | None = None) -> torch.Tensor:
        """hc_mix_partials' launch, for the body of a custom op (it, hc_combine_partials and
        router_triton.route_step). combine (y, post, comb, new, n): x is the streams before the
        combine, new [T, n D] receives them after it (hc_combine_partials)."""
        T, K = x.shape
        J = fn.shape[0]
        cfg = launch_config(J, K, split)
        cfg.update({key: value for key, value in zip(cfg, (block_t, block_k, num_warps, num_stages)) if value})
        k_per_split = triton.cdiv(triton.cdiv(K, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        out = torch.empty(split, T, J + 1, device=x.device, dtype=torch.float32)
        y, post, comb, new, n = combine or (x, out, out, x, 0)
        D = K // max(n, 1)
        assert not n or D % cfg["BLOCK_K"] == 0, "a combined tile lies within one stream"
        grid = (triton.cdiv(T, cfg["BLOCK_T"]), split)
        torch.library.wrap_triton(_partials_kernel)[grid](
            x, fn, out, T, J, K, k_per_split, *x.stride(), *fn.stride(), out.stride(0), out.stride(1),
            y, post, comb, new, D, BLOCK_J=max(16, triton.next_power_of_2(J)), EVEN_K=K % cfg["BLOCK_K"] == 0,
            PRECISION=precision or PRECISION, INTERPRETED=_gt.interpreted(), N_HC=n, **cfg)
        return out

    @torch.library.triton_op("lockstep::hc_combine_partials", mutates_args=())
    def hc_combine_partials(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                            fn: torch.Tensor, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The mHC combine after a block and the next block's projection partials in one kernel:
        streams [T, n, D] bf16, the block output y [T, D] bf16, its post [T, n] and comb [T, n, n]
        (fp32) -> (hc_mix_partials of the combined streams, the combined streams [T, n, D]
        (hyper_connection.hc_combine's, in eager's roundings)). D a multiple of the launch's BLOCK_K."""
        T, n, D = streams.shape
        x = streams.reshape(T, n * D).contiguous()
        new = torch.empty_like(x)
        combine = (y.contiguous(), post.contiguous(), comb.contiguous(), new, n)
        return launch_partials(x, fn, split, combine=combine), new.view(T, n, D)

    @hc_combine_partials.register_fake
    def _(streams, y, post, comb, fn, split):
        T = streams.shape[0]
        return streams.new_empty(split, T, fn.shape[0] + 1, dtype=torch.float32), torch.empty_like(streams)

    # Shapes for torch.compile's tracing, written out: the default (the body run on fake tensors)
    # would launch the kernel itself under the interpreter, which wrap_triton leaves unwrapped.
    @hc_mix_partials.register_fake
    def _(x, fn, split, *config, **options):
        return x.new_empty(split, x.shape[0], fn.shape[0] + 1, dtype=torch.float32)


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, eps: float, split: int = 0, in_order: bool = False,
             **config) -> torch.Tensor:
    """F.linear(rms_norm(x.float(), eps), fn.float()) for x [T, K], fn [J, K] -> [T, J] fp32:
    the kernel's partials, then their sum over splits scaled by each row's rsqrt(mean(x^2) + eps).
    `in_order`: the splits are added first to last (sum_splits_in_order), so a row's mixes are the
    same bits at any T (whole_rows.py); else torch's sum, which a compiled decode step fuses.
    `split` (0: default_split) and `config` (block_t, block_k, num_warps, num_stages) are the
    benchmark's overrides."""
    J, K = fn.shape
    partials = hc_mix_partials(x, fn, split or default_split(K), **config)
    sums = _ss.sum_splits_in_order(partials) if in_order else partials.sum(0)
    return sums[:, :J] * torch.rsqrt(sums[:, J:] / K + eps)
