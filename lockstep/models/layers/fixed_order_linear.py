"""A batch-invariant GEMM, y = x @ w^T, as a Triton kernel registered as the custom op
`lockstep::fixed_order_linear` (issue 16, item 2: one set of fixed-order kernels on the policy
path, so a token's logprob does not depend on batch size, composition, chunking or padding).

What is invariant, and why: output row m is a function of x[m] and w only, bit for bit, whatever
M, the other rows (garbage padding included) and the row's position in the batch. A program owns
one BLOCK_M x BLOCK_N output tile of one split of K and walks its K in BLOCK_K tiles in index
order, accumulating in fp32 (tl.dot); rows of a tile do not mix (each output element is its own
dot product). The splits' fp32 sums are then added first to last (sum_splits_triton.py) and
rounded to x's dtype once. BLOCK_N, BLOCK_K, warps, stages and the split count, which fix each
element's order of sums, are chosen from (N, K) only (`launch_config`): a fixed split-K, no
atomics, no autotune (which could pick another config per M). BLOCK_M, the rows a program holds,
follows M as well (16 for a decode step's few rows, 64 for prefill and training's thousands):
it decides which rows share a program, not an element's sums. On Hopper the two are different
instructions (mma.sync at 16 rows, wgmma at 64) and measured bit-equal on an H200 (bf16 and fp32,
nine weight shapes, 4,096 rows, 16 / 32 / 64 / 128 rows per tile; 2026-12-02), and the CUDA
equality tests compare decode rows (16) with training rows (64). M is not specialised on beyond
that (do_not_specialize: M == 1 would compile a second kernel). Keyword overrides of BLOCK_N,
BLOCK_K or the split change the sums' order: every path of one run must use the same.

Why split K: at decode (a few dozen rows) a narrow weight has one or two column tiles per 16 rows,
a handful of programs each walking all of K in series (`launch_config` says where it pays).

Numerics: bf16 x and w: fp32 accumulation of bf16 products, rounded to bf16 once (nearest even),
or kept in fp32 (`fp32_out`: the LM head's logits; a bf16 product is exact in fp32, so it sums the
terms an fp32 GEMM of the upcast inputs sums); fp32: tl.dot with input_precision="ieee" (no TF32),
fp32 result. The reference
(`fixed_order_linear_reference`, fp32 matmul rounded once) sums in another order: 1 bf16 ulp apart,
equal where every partial sum is exact. Interpreter (CPU tests) gaps bridged as in
grouped_gemm_triton.py, whose _dot / _bf16 helpers this kernel shares.

`fixed_order_linear(x, w)` takes the kernel where it runs (CUDA, or the interpreter) and the
reference elsewhere, or when a gradient is wanted: forward only, no autograd registered. A grouped
weight [G, N, K] (DeepSeek-V4's wo_a) runs its G GEMMs in one launch, each with its own [N, K]
config and sums. The true-on-policy forward calls it over whole rows (whole_rows.linear). H200,
benchmarks/fixed_order_linear.py: 64 rows 0.77-0.96x cuBLAS's time per call; 4,096 rows 0.59-0.84x
with 64-row tiles (0.24-0.54x with 16, weight tiles re-read per 16 rows, mma.sync, not wgmma).
"""

from __future__ import annotations

import torch

from lockstep.triton_support import interpreted

from . import grouped_gemm_triton as _gt
from . import sum_splits_triton as _ss

triton = _gt.triton
if triton is not None:
    import triton.language as tl

DTYPES = (torch.bfloat16, torch.float32)


def fixed_order_linear_reference(x: torch.Tensor, w: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T in fp32, rounded once to x's dtype (fp32_out: not rounded); grouped:
    x [..., G, K], w [G, N, K] -> [..., G, N], group g's rows through w[g]."""
    if w.dim() == 3:
        y = torch.einsum("...gk,gnk->...gn", x.float(), w.float())
    else:
        y = x.float() @ w.float().T
    return y if fp32_out else y.to(x.dtype)


def runs_on(x: torch.Tensor) -> bool:
    """Where the fixed-order kernels run: Triton present and x on CUDA (or the interpreter)."""
    return triton is not None and (x.is_cuda or interpreted())


def kernel_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Triton present, CUDA (or the interpreter), bf16 or fp32 x and w alike, no gradient wanted;
    w [N, K], or grouped [G, N, K] with x [..., G, K]."""
    if x.dtype not in DTYPES or w.dtype != x.dtype or w.dim() not in (2, 3):
        return False
    if w.dim() == 3 and (x.dim() < 2 or x.shape[-2] != w.shape[0]):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    return runs_on(x)


def fixed_order_linear(x: torch.Tensor, w: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] in x's dtype (fp32_out: fp32); grouped, x [..., G, K] and
    w [G, N, K] -> [..., G, N] in one launch (DeepSeek-V4's wo_a: a launch per group was 4 GEMMs and
    a stack per layer). The kernel where it applies, else the reference."""
    if not kernel_applies(x, w):
        return fixed_order_linear_reference(x, w, fp32_out)
    rows = x.reshape(-1, *x.shape[-(w.dim() - 1):])  # [M, K] or [M, G, K]
    out = torch.ops.lockstep.fixed_order_linear(rows, w, fp32_out=fp32_out)
    return out.view(*x.shape[:-1], w.shape[-2])


# The LM head (N = the vocabulary): 64 x 128 tiles. Its weight is most of a decode step's bytes, re-read
# per 16 rows with the small tiles (H200, 32768 x 1024: 64 rows 33.1 -> 22.2 us, 4,096 rows 1,947 ->
# 664 us; benchmarks/fixed_order_linear.py --block-m 64 --block-n 128), whatever the row count.
WIDE_N = 8192
# Split K only where the weight has few column tiles (N <= 128: the router, wkv, the indexer's head
# weights): there a decode step had a handful of programs walking all of K in series (the 1b config's
# fp32 router, 64 x 1024, took 44 us in a decode step on an H200). Elsewhere a split cost more than
# it saved (benchmarks/fixed_order_linear.py, H200, 64 rows: wo_a 256 x 512 3.2 -> 3.8 us, wq_a
# 512 x 1024 4.8 -> 4.3 us; 4,096 rows: wq_a 31.6 -> 48.8 us, the fp32 partials' traffic).
FEW_COLUMN_TILES = 2
MAX_SPLIT = 4
MIN_SPLIT_TILES = 4  # K tiles a split keeps at least
# Rows per tile of the narrower weights: 16 below MANY_ROWS rows (decode: with 64 a decode step's
# GEMMs took 10-40% longer, wq_a 5.0 -> 5.6 us at 64 rows), 64 from there (training's 4,096-row GEMMs
# 0.24-0.54x -> 0.59-0.84x of cuBLAS; a true-on-policy train step's exact forward 61 -> 44 ms, 1b,
# 4 x 1024, timed apart from the rest of the step). H200, benchmarks/fixed_order_linear.py --block-m.
MANY_ROWS = 256


def launch_config(N: int, K: int, M: int = 0) -> dict:
    """The sums' order by the weight's shape only (module docstring): up to 64 output columns and 64
    of K per step, smaller for small dimensions, the head (WIDE_N) 128 columns; K split in up to
    MAX_SPLIT where the columns make FEW_COLUMN_TILES tiles or fewer. Rows per tile: 64 for the head
    and from MANY_ROWS rows, else 16 (tl.dot's minimum; decode has a few dozen rows)."""
    block_k = min(64, max(16, triton.next_power_of_2(K)))
    wide = N >= WIDE_N
    block_n = 128 if wide else min(64, max(16, triton.next_power_of_2(N)))
    block_m = 64 if wide or M >= MANY_ROWS else 16
    split = 1
    if triton.cdiv(N, block_n) <= FEW_COLUMN_TILES:
        split = max(1, min(MAX_SPLIT, triton.cdiv(K, block_k) // MIN_SPLIT_TILES))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=3)


def split_extent(K: int, block_k: int, split: int) -> tuple[int, int]:
    """(K per split, a multiple of block_k; the number of splits that K fills)."""
    k_per_split = triton.cdiv(triton.cdiv(K, block_k), split) * block_k
    return k_per_split, triton.cdiv(K, k_per_split)


if triton is not None:
    # by name, not as _gt._dot: torch.compile's compile worker cannot resolve a module alias
    _dot, _bf16 = _gt._dot, _gt._bf16

    @triton.jit(do_not_specialize=["M"])
    def _fixed_order_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, n_splits, stride_xg, stride_xm,
                                   stride_xk, stride_wg, stride_wn, stride_wk, stride_os, stride_og, stride_om,
                                   stride_on, BF16: tl.constexpr, ROUND: tl.constexpr, INTERPRETED: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[s, m, g, n] = sum over K tiles k0 = s * k_per_split, + BLOCK_K, ... (in this order, up
        to the split's end) of x[m, g, k0:] . w[g, n, k0:]; program_id(2) = g * n_splits + s (one
        group, stride 0, ungrouped)."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = (tl.program_id(2) // n_splits).to(tl.int64)
        s = tl.program_id(2) % n_splits
        x_ptr += g * stride_xg
        w_ptr += g * stride_wg
        out_ptr += g * stride_og
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_tile = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk
        w_tile = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None] * stride_wk  # [BLOCK_K, BLOCK_N] of w^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = s * k_per_split
        for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
            k_ok = k0 + rk < K
            a = tl.load(x_tile + k0 * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile + k0 * stride_wk, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if BF16 or INTERPRETED:
                acc = _dot(a, b, acc, INTERPRETED)
            else:
                acc = tl.dot(a, b, acc, input_precision="ieee")
        if ROUND:
            result = _bf16(acc, INTERPRETED)
        else:
            result = acc
        out_tile = out_ptr + s.to(tl.int64) * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on
        tl.store(out_tile, result, mask=m_ok[:, None] & n_ok[None, :])

    @torch.library.triton_op("lockstep::fixed_order_linear", mutates_args=())
    def _fixed_order_linear_op(x: torch.Tensor, w: torch.Tensor, block_m: int = 0, block_n: int = 0,
                               block_k: int = 0, fp32_out: bool = False, split_k: int = 0) -> torch.Tensor:
        """x [M, K], w [N, K], both bf16 or both fp32 -> [M, N] in x's dtype (fp32_out: fp32); grouped:
        x [M, G, K], w [G, N, K] -> [M, G, N], each group's config and sums those of its own [N, K]
        GEMM. Nonzero block / split keywords override `launch_config` (block_n, block_k and split_k
        the same on every path, or rows are no longer comparable)."""
        x3, w3 = (x, w) if w.dim() == 3 else (x.unsqueeze(1), w.unsqueeze(0))
        M, G, K = x3.shape
        N = w3.shape[1]
        cfg = launch_config(N, K, M)
        for key, value in zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"), (block_m, block_n, block_k, split_k)):
            if value:
                cfg[key] = value
        k_per_split, splits = split_extent(K, cfg["BLOCK_K"], cfg.pop("SPLIT_K"))
        round_bf16 = x.dtype == torch.bfloat16 and not fp32_out
        out_dtype = torch.float32 if fp32_out else x.dtype
        shape = (*x.shape[:-1], N)
        if M == 0:
            return x.new_empty(shape, dtype=out_dtype)
        # one split: the tile's sum is the result; more: fp32 partials, added in order after
        out = x.new_empty(shape, dtype=out_dtype) if splits == 1 else x.new_empty(splits, *shape, dtype=torch.float32)
        out4 = out.view(splits, M, G, N)
        grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), G * splits)
        torch.library.wrap_triton(_fixed_order_linear_kernel)[grid](
            x3, w3, out4, M, N, K, k_per_split, splits, x3.stride(1), x3.stride(0), x3.stride(2), w3.stride(0),
            w3.stride(1), w3.stride(2), out4.stride(0), out4.stride(2), out4.stride(1), out4.stride(3),
            BF16=x.dtype == torch.bfloat16, ROUND=round_bf16 and splits == 1, INTERPRETED=interpreted(), **cfg)
        return out if splits == 1 else _ss.sum_splits_in_order(out, out_bf16=round_bf16)

    # shapes for torch.compile's tracing, written out (grouped_gemm_triton.py says why)
    @_fixed_order_linear_op.register_fake
    def _(x, w, block_m=0, block_n=0, block_k=0, fp32_out=False, split_k=0):
        return x.new_empty(*x.shape[:-1], w.shape[-2], dtype=torch.float32 if fp32_out else x.dtype)
