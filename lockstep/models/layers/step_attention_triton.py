"""A decode step's core attention, read from the layer's caches in place, as one Triton kernel
registered as the custom op `lockstep::sink_attention_step`.

What: out_h = sum_k softmax_k([l_h(k)..., sink_h]) v_k, l_h(k) = q_h . k_k * scale, for each
sequence's one new token, over the keys it sees (K = V: one shared KV head):
- its window: the ring cache [slots, W, D] of its slot, read after the step wrote the token's key
  (window_ring.write_window). At a decode step the ring then holds exactly the positions the token
  sees, p - W + 1 .. p (ring index = position mod W); before position W - 1 its indices above p
  are empty. So ring index i is seen iff i <= p.
- its compressed entries [slots, capacity, D] (Compressor's state), either the closed blocks
  j < (p + 1) // rate (HCA: dense) or the indexer's picks [N, k] (CSA; -1: no pick).
A program takes one sequence: its H heads' queries as an [H, D] tile against [BLOCK_K, D] key
tiles, the ring's (up to the position) in one loop and the entries' (through the slot and the
picks) in another.

Why: the torch form assembles the keys first: the ring gathered for the batch, the token's key
and the entries concatenated, a 0 / -inf bias built from positions, both padded; a few MB a layer
written and read back, and several launches. With the entries read through the picks, the work
follows the positions and the index_topk picks, not the cache's capacity (the torch form attends
over every entry of capacity max_model_len / rate under a CUDA graph, most of them masked).
Measured on one H200 (2026-12-03, benchmarks/step_attention.py, batch 64, 16 x 128, window 128,
against the torch form's assembly and attention compiled): window 5.2 us a call against 34.4;
C128 entries 7.2 against 39.1 at 192 positions, 7.9 against 67.3 at 8,192; C4 with 128 picks 10.3
against 47.3 at 192 and 13.8 against 372 (27x) at 8,192. (One loop over both sources, loading each
tile from both, took 12.2 and 15.2 us at 192.)

Numerics, as the torch form rounds: the scores q . k in fp32 rounded to the keys' dtype (the
einsum's output), then in fp32 times scale (an unseen key is -inf, as its bias makes it); the
softmax in fp32 over the keys and the sink; the probabilities rounded to the keys' dtype before
P V; P V accumulated in fp32 and rounded once. Two passes over the keys: the running max and sum
(the sink folded in first, so a row that sees no key stays finite), then each probability
exp(l - max) / sum as the torch form computes it (not an online softmax's rescaled partial
products). Sums run in another order: equal to the torch form to a bf16 ulp, not bitwise
(tests/models/test_step_attention_triton.py). The true-on-policy forward does not use it (its
attention is attention_rows.py's).

Where (`runs`): the triton_attention switch (EngineConfig.triton_attention; kernel_switch.py), a
decode step (one query position: a compiled decode graph's specialisation, so the choice adds no
guard), CUDA, bf16, no gradient wanted. Forward only. Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt
from .kernel_switch import forward_kernel_allowed

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_K = 64  # keys per tile


def runs(q: torch.Tensor, enabled: bool) -> bool:
    """Whether a step's attention for queries q [N, Sq, H, D] takes the kernel (module docstring)."""
    return (triton is not None and forward_kernel_allowed(enabled, q) and q.shape[1] == 1
            and q.dtype == torch.bfloat16)


# how the kernel finds a sequence's compressed entries (its ENTRIES constexpr)
NO_ENTRIES, CLOSED_BLOCKS, PICKED = 0, 1, 2


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _dot, _bf16 = _gt._dot, _gt._bf16

    @triton.jit
    def _scores(q, k, seen, scale, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """Scores [BLOCK_H, BLOCK_K] of a key tile as the torch form makes them; -inf where not seen."""
        s = _dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), dtype=tl.float32), INTERPRETED)
        if BF16:  # the einsum's bf16 output
            s = _bf16(s, INTERPRETED).to(tl.float32)
        return tl.where(seen[None, :], s * scale, float("-inf"))

    @triton.jit
    def _ring_tile(q, ring_row, v0, p, W, rd, stride_rw, scale, D: tl.constexpr, BLOCK_K: tl.constexpr,
                   BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """Ring indices v0 .. v0 + BLOCK_K -> (keys [BLOCK_K, BLOCK_D], scores): index i is seen iff
        i <= p (module docstring: the ring after the step's write)."""
        v = v0 + tl.arange(0, BLOCK_K)
        seen = (v < W) & (v <= p)
        k = tl.load(ring_row + v[:, None] * stride_rw + rd[None, :], mask=seen[:, None] & (rd[None, :] < D),
                    other=0.0)
        return k, _scores(q, k, seen, scale, BF16, INTERPRETED)

    @triton.jit
    def _entry_tile(q, ent_row, picks_row, e0, n_ent, rd, stride_ee, scale, D: tl.constexpr, BLOCK_K: tl.constexpr,
                    ENTRIES: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """The sequence's entries e0 .. e0 + BLOCK_K of n_ent (PICKED: through the picks, -1 unseen;
        CLOSED_BLOCKS: the first n_ent) -> (keys, scores)."""
        e = e0 + tl.arange(0, BLOCK_K)
        seen = e < n_ent
        if ENTRIES == 2:  # PICKED
            j = tl.load(picks_row + e, mask=seen, other=-1)
            seen = seen & (j >= 0)
        else:
            j = e
        k = tl.load(ent_row + j[:, None].to(tl.int64) * stride_ee + rd[None, :],
                    mask=seen[:, None] & (rd[None, :] < D), other=0.0)
        return k, _scores(q, k, seen, scale, BF16, INTERPRETED)

    @triton.jit
    def _max_and_sum(m, total, s):
        """The running max and sum of exp(l - max) after one more tile of scores."""
        new_m = tl.maximum(m, tl.max(s, axis=1))
        return new_m, total * tl.exp(m - new_m) + tl.sum(tl.exp(s - new_m[:, None]), axis=1)

    @triton.jit
    def _add_pv(acc, k, s, m, total, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """acc + P V of one tile, each probability exp(l - max) / sum as the torch form computes it."""
        prob = tl.exp(s - m[:, None]) / total[:, None]
        if BF16:
            prob = _bf16(prob, INTERPRETED)
        return _dot(prob, k, acc, INTERPRETED)

    @triton.jit
    def _step_kernel(q_ptr, ring_ptr, slots_ptr, pos_ptr, ent_ptr, picks_ptr, sinks_ptr, out_ptr,
                     W, capacity, num_picks, rate, stride_pos, stride_rs, stride_rw, stride_es, stride_ee,
                     stride_pn, scale, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, ENTRIES: tl.constexpr, BF16: tl.constexpr,
                     INTERPRETED: tl.constexpr):
        """Program n: sequence n's token over its ring (indices <= p), then its entries; two passes
        (the running max and sum, then P V), each over the ring's tiles and the entries' tiles."""
        n = tl.program_id(0).to(tl.int64)
        scale = tl.cast(scale, tl.float32)
        slot = tl.load(slots_ptr + n).to(tl.int64)
        p = tl.load(pos_ptr + n * stride_pos)
        n_ring = tl.minimum(W, p + 1)  # tiles past the position hold nothing it sees: skipped, exactly
        if ENTRIES == 1:  # CLOSED_BLOCKS: compressor.closed_entries, within the capacity
            n_ent = tl.minimum(tl.maximum((p + 1) // rate, 0), capacity)
        else:
            n_ent = num_picks
        ring_row = ring_ptr + slot * stride_rs
        ent_row = ent_ptr + slot * stride_es
        picks_row = picks_ptr + n * stride_pn
        rh = tl.arange(0, BLOCK_H)
        rd = tl.arange(0, BLOCK_D)
        tile = (rh[:, None] < H) & (rd[None, :] < D)
        q = tl.load(q_ptr + (n * H + rh[:, None]) * D + rd[None, :], mask=tile, other=0.0)
        m = tl.load(sinks_ptr + rh, mask=rh < H, other=0.0).to(tl.float32)  # the sink folded in first
        total = tl.full((BLOCK_H,), 1.0, dtype=tl.float32)
        for v0 in range(0, n_ring, BLOCK_K):
            _, s = _ring_tile(q, ring_row, v0, p, W, rd, stride_rw, scale, D, BLOCK_K, BF16, INTERPRETED)
            m, total = _max_and_sum(m, total, s)
        if ENTRIES != 0:
            for e0 in range(0, n_ent, BLOCK_K):
                _, s = _entry_tile(q, ent_row, picks_row, e0, n_ent, rd, stride_ee, scale, D, BLOCK_K, ENTRIES, BF16,
                                   INTERPRETED)
                m, total = _max_and_sum(m, total, s)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for v0 in range(0, n_ring, BLOCK_K):
            k, s = _ring_tile(q, ring_row, v0, p, W, rd, stride_rw, scale, D, BLOCK_K, BF16, INTERPRETED)
            acc = _add_pv(acc, k, s, m, total, BF16, INTERPRETED)
        if ENTRIES != 0:
            for e0 in range(0, n_ent, BLOCK_K):
                k, s = _entry_tile(q, ent_row, picks_row, e0, n_ent, rd, stride_ee, scale, D, BLOCK_K, ENTRIES, BF16,
                                   INTERPRETED)
                acc = _add_pv(acc, k, s, m, total, BF16, INTERPRETED)
        if BF16:
            out = _bf16(acc, INTERPRETED)
        else:
            out = acc
        tl.store(out_ptr + (n * H + rh[:, None]) * D + rd[None, :], out, mask=tile)

    @torch.library.triton_op("lockstep::sink_attention_step", mutates_args=())
    def sink_attention_step(q: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                            sinks: torch.Tensor, scale: float, entries: torch.Tensor | None = None,
                            picks: torch.Tensor | None = None, rate: int = 0) -> torch.Tensor:
        """q [N, 1, H, D] at positions [N, 1] of sequences in cache slots [N]; ring [slots, W, D] (the
        step's keys written); sinks [H] -> [N, 1, H, D]. entries [slots, capacity, D] with picks
        [N, 1, k] (indices, -1: none) or, without picks, the closed blocks of `rate` positions."""
        N, _, H, D = q.shape
        _check_rows(ring, "ring")
        q = q.contiguous()
        mode = NO_ENTRIES if entries is None else CLOSED_BLOCKS if picks is None else PICKED
        if entries is not None:
            _check_rows(entries, "entries")
        if mode == CLOSED_BLOCKS and rate < 1:
            raise ValueError(f"sink_attention_step: closed-block entries need rate >= 1, got {rate}")
        ent = ring if entries is None else entries  # placeholders the kernel never reads for its mode
        pk = slots if picks is None else picks.reshape(N, -1)
        out = torch.empty_like(q)
        torch.library.wrap_triton(_step_kernel)[(N,)](
            q, ring, slots, positions, ent, pk, sinks.contiguous(), out, ring.shape[1], ent.shape[1],
            pk.shape[1] if mode == PICKED else 0, max(rate, 1), positions.stride(0), ring.stride(0),
            ring.stride(1), ent.stride(0), ent.stride(1), pk.stride(0), scale, H=H, D=D,
            BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_D=max(16, triton.next_power_of_2(D)),
            BLOCK_K=BLOCK_K, ENTRIES=mode, BF16=q.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(),
            num_warps=4)
        return out

    # Shapes for torch.compile's tracing, written out: the default (the body run on fake tensors)
    # would launch the kernel itself under the interpreter, which wrap_triton leaves unwrapped.
    @sink_attention_step.register_fake
    def _(q, ring, slots, positions, sinks, scale, entries=None, picks=None, rate=0):
        return torch.empty_like(q)


def _check_rows(cache: torch.Tensor, name: str) -> None:
    """The kernel steps along a cached key by 1: a cache whose rows are not contiguous is refused
    (copying it would read the whole cache every step)."""
    if cache.dim() != 3 or cache.stride(2) != 1:
        raise ValueError(f"sink_attention_step: {name} must be [slots, rows, D] with contiguous rows, "
                         f"got shape {tuple(cache.shape)} strides {cache.stride()}")
