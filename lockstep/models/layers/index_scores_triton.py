"""The C4 layers' lightning-indexer scores over whole rows as one Triton kernel, registered as the
custom op `lockstep::index_scores` (issue 16, item 2: the indexer's selection bitwise the same for
a prefill row, a decode row and a training row).

What: key_tiles.tiled_index_scores' formula (indexer.py's) for every row and every compressed
entry of its sequence, in one launch instead of 64-row blocks of batched GEMMs (on an H200, 1b
config, 4 x 1024 tokens: ~16 ms per C4 layer in row blocks, the largest cost of the whole-rows
forward):
    score(r, j) = sum_h w[r, h] * ReLU(q[r, h] . k[base[r] + j]) * D_I^-0.5,   j < count[r]
and -inf for j >= count[r] (not closed yet, or past the sequence's entries; those keys are not read).

What is invariant, and why: one program owns one row and one TILE of its entries. The dot over
D_I (tl.dot over one zero-padded BLOCK_D tile), the sum over heads (tl.sum's fixed tree per
BLOCK_H heads, the head blocks added first to last) depend on H_I, D_I and the constants, never on
the number of rows, the other rows, or how many entries the caller passes (the trainer's sequence
holds S / m, the engine's cache its capacity).

A zero score is +0.0 (the head sums are added to +0.0, and +0.0 + -0.0 = +0.0): the indexer picks by
sorting the scores, and torch's CUDA sort chooses its algorithm by the row length, which differs
between the trainer and the engine; a radix sort orders by bits (-0.0 below 0.0) where a comparison
sort calls them tied. With one zero, every stable sort gives the same picks.

Numerics (not the torch reference's bits; both sides run this kernel): bf16 products exact in
fp32, accumulated in fp32 (tl.dot); fp32 inputs as IEEE fp32 dots. Close to the reference to
fp32 rounding (tests). Forward only; CPU tests under TRITON_INTERPRET=1
(tests/models/test_index_scores_triton.py).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl

TILE = 64  # entries per program (key_tiles.ENTRY_TILE)
BLOCK_H = 16  # heads per tl.dot: its minimum rows


def available(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """The kernel can run: Triton, CUDA (or the interpreter), bf16 or fp32 q like the keys, no
    gradient wanted."""
    return q.dim() == 3 and keys.dtype == q.dtype and _gt.forward_kernel_runs(q)


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _dot = _gt._dot

    @triton.jit
    def _index_scores_kernel(q_ptr, w_ptr, k_ptr, base_ptr, count_ptr, out_ptr, H, D, L, scale, stride_qr, stride_qh,
                             stride_wr, stride_k, stride_or, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                             TILE: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        scale = tl.cast(scale, tl.float32)  # a no-op launched eagerly; inductor passes floats as fp64
        r = tl.program_id(0).to(tl.int64)
        rj = tl.program_id(1) * TILE + tl.arange(0, TILE)
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < D
        count = tl.minimum(tl.load(count_ptr + r), L)
        ok = rj < count
        score = tl.zeros((TILE,), dtype=tl.float32)  # +0.0: a zero sum stays +0.0 (the module docstring)
        if tl.program_id(1) * TILE < count:  # a tile past the row's entries is all -inf: nothing read
            idx = tl.load(base_ptr + r) + rj
            keys = tl.load(k_ptr + idx[:, None] * stride_k + rd[None, :], mask=ok[:, None] & d_ok[None, :],
                           other=0.0)
            for h0 in range(0, H, BLOCK_H):
                rh = h0 + tl.arange(0, BLOCK_H)
                h_ok = rh < H
                q = tl.load(q_ptr + r * stride_qr + rh[:, None] * stride_qh + rd[None, :],
                            mask=h_ok[:, None] & d_ok[None, :], other=0.0)
                zero = tl.zeros((BLOCK_H, TILE), dtype=tl.float32)
                if BF16 or INTERPRETED:
                    dots = _dot(q, tl.trans(keys), zero, INTERPRETED)
                else:
                    dots = tl.dot(q, tl.trans(keys), zero, input_precision="ieee")
                w = tl.load(w_ptr + r * stride_wr + rh, mask=h_ok, other=0.0)
                score += tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
        score = tl.where(ok, score, float("-inf"))
        tl.store(out_ptr + r * stride_or + rj, score, mask=rj < L)

    @torch.library.triton_op("lockstep::index_scores", mutates_args=())
    def index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, base: torch.Tensor,
                     count: torch.Tensor, num_entries: int) -> torch.Tensor:
        """q [R, H_I, D_I] (roped index queries), head_weights [R, H_I] fp32 (scaled by H_I^-0.5),
        keys [M, D_I] (every sequence's index keys, flat), base [R] (row r's entry j is keys[base[r] + j]),
        count [R] (entries row r may see) -> scores [R, num_entries] fp32, -inf from count[r] on."""
        R, H, D = q.shape
        out = torch.empty(R, num_entries, dtype=torch.float32, device=q.device)
        if R == 0 or num_entries == 0:
            return out
        q, w, k = q.contiguous(), head_weights.float().contiguous(), keys.contiguous()
        grid = (R, triton.cdiv(num_entries, TILE))
        torch.library.wrap_triton(_index_scores_kernel)[grid](
            q, w, k, base.contiguous(), count.contiguous(), out, H, D, num_entries, D**-0.5, q.stride(0), q.stride(1),
            w.stride(0), k.stride(0), out.stride(0), BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_H=BLOCK_H,
            TILE=TILE, BF16=q.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(), num_warps=4)
        return out

    @index_scores.register_fake
    def _(q, head_weights, keys, base, count, num_entries):
        return q.new_empty(q.shape[0], num_entries, dtype=torch.float32)
