"""The true-on-policy attention core over whole rows as one Triton kernel, registered as the custom
op `lockstep::tiled_sink_attention` (issue 16, item 2: attention reducing over keys in fixed tiles
in position order, identically for a prefill row, a decode row and a training row).

What: key_tiles.tiled_sink_attention's online softmax (read that docstring first), for every row
in one launch instead of 64-row blocks of ~15 torch ops per tile. A row's keys are gathered by
index from two sources: its sliding window (`window_index` / `window_valid` [R, W] into
`window_source`), then the compressed entries (`entry_index` / `entry_valid` [R, L] into
`entry_source`), walked in TILE-wide tiles in that order, the sink folded in first (running max =
sink, running sum = 1). K = V (DeepSeek-V4's shared KV head).

What is invariant, and why: one program owns one row and BLOCK_H of its heads. Its tiles, their
order, the dot products' accumulation (tl.dot over the head dim) and the tile sums (tl.sum's fixed
tree) depend on W, L, D and the config, never on the number of rows or on the other rows. A tile
whose keys are all masked is an exact no-op (max unchanged, rescale exp(0) = 1, zeros added), so
a program stops after the last tile its row can see (`entry_reach`: the trainer's and the engine's
entry counts differ; the bits do not).

Numerics (not the torch reference's bits; both sides run this kernel): scores = q . k in fp32
(bf16 products, fp32 accumulation; fp32 inputs: IEEE fp32 dots), times `scale`; probabilities
exp(s - max) in fp32 (the GPU's fast exp: a fixed function, so fixed bits), rounded to the keys'
dtype before the probabilities x values dot (as the reference's bmm); output acc / sum rounded
once to q's dtype. Close to the reference to bf16 rounding (tests).

Forward only (no autograd): the true-on-policy forward computes without gradients. CPU tests run
it under TRITON_INTERPRET=1 (tests/models/test_tiled_attention_triton.py).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl

TILE = 64  # keys per tile: key_tiles.ENTRY_TILE (the window's W keys walk in tiles of this width too)
BLOCK_H = 16  # heads per program: tl.dot's minimum rows


def available(q: torch.Tensor, window_source: torch.Tensor) -> bool:
    """The kernel can run: Triton, CUDA (or the interpreter), bf16 or fp32 q like the keys, a
    power-of-two head dim >= 16, no gradient wanted."""
    D = q.shape[-1]
    if q.dim() != 3 or window_source.dtype != q.dtype or D < 16 or D & (D - 1):
        return False
    return _gt.forward_kernel_runs(q)


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _dot, _bf16 = _gt._dot, _gt._bf16

    @triton.jit
    def _tile(q, src_ptr, index_ptr, valid_ptr, stride_s, k0, n, m, s_sum, acc, scale, rd,
              TILE: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """One tile of the online softmax: keys k0 .. k0 + TILE of a row (n in all)."""
        rk = k0 + tl.arange(0, TILE)
        in_row = rk < n
        ok = (tl.load(valid_ptr + rk, mask=in_row, other=0) != 0) & in_row
        idx = tl.load(index_ptr + rk, mask=ok, other=0)
        keys = tl.load(src_ptr + idx[:, None].to(tl.int64) * stride_s + rd[None, :], mask=ok[:, None], other=0.0)
        zero = tl.zeros((q.shape[0], TILE), dtype=tl.float32)
        if BF16 or INTERPRETED:
            scores = _dot(q, tl.trans(keys), zero, INTERPRETED)
        else:
            scores = tl.dot(q, tl.trans(keys), zero, input_precision="ieee")
        scores = tl.where(ok[None, :], scores * scale, float("-inf"))
        new_m = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp(m - new_m)
        probs = tl.exp(scores - new_m[:, None])
        s_sum = s_sum * rescale + tl.sum(probs, axis=1)
        if BF16:
            p = _bf16(probs, INTERPRETED)
        else:
            p = probs
        zero_d = tl.zeros((q.shape[0], keys.shape[1]), dtype=tl.float32)
        if BF16 or INTERPRETED:
            pv = _dot(p, keys, zero_d, INTERPRETED)
        else:
            pv = tl.dot(p, keys, zero_d, input_precision="ieee")
        return new_m, s_sum, acc * rescale[:, None] + pv

    @triton.jit
    def _tiled_attention_kernel(q_ptr, w_src, w_index, w_valid, e_src, e_index, e_valid, e_reach, sinks_ptr, out_ptr,
                                H, W, L, scale, stride_qr, stride_qh, stride_ws, stride_wr, stride_es, stride_er,
                                stride_or, stride_oh, D: tl.constexpr, BLOCK_H: tl.constexpr, TILE: tl.constexpr,
                                HAS_ENTRIES: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """out[r, heads] = softmax over [sink; window keys; entries] of q . k, times the keys, walked in tiles."""
        scale = tl.cast(scale, tl.float32)  # a no-op launched eagerly; inductor passes floats as fp64
        r = tl.program_id(0).to(tl.int64)
        rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        rd = tl.arange(0, D)
        h_ok = rh < H
        q = tl.load(q_ptr + r * stride_qr + rh[:, None] * stride_qh + rd[None, :], mask=h_ok[:, None], other=0.0)
        m = tl.load(sinks_ptr + rh, mask=h_ok, other=0.0).to(tl.float32)
        s_sum = tl.full((BLOCK_H,), 1.0, dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, D), dtype=tl.float32)
        for k0 in range(0, W, TILE):
            m, s_sum, acc = _tile(q, w_src, w_index + r * stride_wr, w_valid + r * stride_wr, stride_ws, k0, W, m,
                                  s_sum, acc, scale, rd, TILE, BF16, INTERPRETED)
        if HAS_ENTRIES:
            reach = tl.minimum(tl.load(e_reach + r), L)  # the tiles past it are all masked: skipped
            for k0 in range(0, reach, TILE):
                m, s_sum, acc = _tile(q, e_src, e_index + r * stride_er, e_valid + r * stride_er, stride_es, k0,
                                      L, m, s_sum, acc, scale, rd, TILE, BF16, INTERPRETED)
        out = acc / s_sum[:, None]
        if BF16:
            out = _bf16(out, INTERPRETED)
        tl.store(out_ptr + r * stride_or + rh[:, None] * stride_oh + rd[None, :], out, mask=h_ok[:, None])

    @torch.library.triton_op("lockstep::tiled_sink_attention", mutates_args=())
    def tiled_sink_attention(q: torch.Tensor, window_source: torch.Tensor, window_index: torch.Tensor,
                             window_valid: torch.Tensor, entry_source: torch.Tensor | None,
                             entry_index: torch.Tensor | None, entry_valid: torch.Tensor | None,
                             entry_reach: torch.Tensor | None, sinks: torch.Tensor, scale: float) -> torch.Tensor:
        """q [R, H, D]; window_source [M, D] with window_index / window_valid [R, W]; optionally
        entry_source [E, D] with entry_index / entry_valid [R, L] and entry_reach [R] (entries a row
        may see at most); sinks [H] -> [R, H, D] in q's dtype. Indices of invalid keys are not read."""
        R, H, D = q.shape
        out = q.new_empty(R, H, D)
        if R == 0:
            return out
        q, ws = q.contiguous(), window_source.contiguous()
        wi, wv = window_index.contiguous(), window_valid.contiguous()
        has_entries = entry_source is not None
        if has_entries:
            es, ei, ev = entry_source.contiguous(), entry_index.contiguous(), entry_valid.contiguous()
            reach, L = entry_reach.contiguous(), ei.shape[1]
        else:
            es, ei, ev, reach, L = ws, wi, wv, wi, 0
        grid = (R, triton.cdiv(H, BLOCK_H))
        torch.library.wrap_triton(_tiled_attention_kernel)[grid](
            q, ws, wi, wv.view(torch.uint8), es, ei, ev.view(torch.uint8), reach, sinks.float().contiguous(), out,
            H, wi.shape[1], L, scale, q.stride(0), q.stride(1), ws.stride(0), wi.stride(0), es.stride(0), ei.stride(0),
            out.stride(0), out.stride(1), D=D, BLOCK_H=BLOCK_H, TILE=TILE, HAS_ENTRIES=has_entries,
            BF16=q.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(), num_warps=4)
        return out

    @tiled_sink_attention.register_fake
    def _(q, *args):
        return q.new_empty(q.shape)
