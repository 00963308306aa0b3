"""A decode step's query and key preparation as one Triton kernel, registered as the custom op
`lockstep::qk_norm_rope_step`: the rotation's cos / sin, the per-head query norm and the key norm,
their rotary embeddings, and the key's write into the sliding-window ring (vLLM's fused_qk_norm_rope
with its reshape_and_cache).

What, per token t (attention.DeepseekV4Attention._normed_rotated and window_ring.write_window have
the torch form):
    q'[t, h] = rope(rms_norm(q[t, h]))                     (unweighted, per head)
    k'[t]    = rope(kv_norm.weight * rms_norm(kv[t]))      -> ring[slot, position % W]
rms_norm in fp32, rounded to bf16; rope rotates the trailing ROPE channels in adjacent pairs by
cos / sin of position * inv_freq (rope_cos_sin's), in fp32, rounded to bf16. A grid of (tokens,
H / BLOCK_H + 1) programs: programs (t, c < H / BLOCK_H) take BLOCK_H query heads each, program
(t, last) the key and its ring slot (the dropped writes go to the scratch slot, as write_window's),
and writes t's cos / sin for the output's rotation back (output_a_triton.py).

Why: compiled, the same is six inductor kernels a layer in the 1b decode step (cos / sin, the
query norm, its rotation, the key norm, its rotation, the ring's scatter): ~9 us of device time and
~3 us idle between them a layer on one H200 (`rollout_throughput.py --step-trace`, 2026-12-04).

Numerics: the same formulas and roundings; cos / sin are the same fp32 product and, on a GPU, the
same functions (libdevice's, which inductor's kernels call too); the sum of squares is a tree
(tl.sum, not inductor's order), rsqrt is libdevice's (inductor's too) and a GPU compiler may
contract a rotation's product and sum into an fma: the torch form's values to a bf16 ulp, most of
them bit for bit (tests/models/test_qk_norm_rope_triton.py). The true-on-policy forward never takes it.

Where (`runs`): DeepseekV4Attention.forward_step where the step attention kernel reads the ring (a
decode step on CUDA without gradients, bf16, the `triton_attention` switch), not over whole rows,
the ring bf16. Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt
from . import rms_norm_grad_triton, rope_triton
from .whole_rows import in_whole_rows

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_H = 4  # query heads per program: the 1b config's 16 heads are 4 programs a token


def runs(q: torch.Tensor, ring: torch.Tensor) -> bool:
    """Whether a step whose attention reads the ring (step_attention_triton.runs said so) prepares
    q [N, S, H, D] and its key by the kernel: bf16 ring and queries, D a power of two, not over whole rows."""
    D = q.shape[-1]
    return (triton is not None and ring.dtype == q.dtype == torch.bfloat16 and D & (D - 1) == 0
            and not in_whole_rows())


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _bf16, _cos_sin, _rotate_pairs = _gt._bf16, rope_triton._cos_sin, rope_triton._rotate_pairs
    _normed_rows = rms_norm_grad_triton._normed_rows

    @triton.jit
    def _normed_rotated(x, weight, cos, sin, eps, R: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
                        WEIGHTED: tl.constexpr, INTERPRETED: tl.constexpr):
        """Rows x [R, D] (fp32 values of bf16) -> rms_norm (times weight [D] where WEIGHTED), rounded
        to bf16, then the trailing ROPE channels rotated (cos / sin [1, D / 2], 1 / 0 outside them),
        rounded to bf16."""
        y = _bf16(_normed_rows(x, weight, D, eps, WEIGHTED), INTERPRETED).to(tl.float32)
        rotated = 2 * tl.arange(0, D // 2) >= D - ROPE
        return _bf16(_rotate_pairs(y, cos, sin, rotated, R, D), INTERPRETED)

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, kv_ptr, w_ptr, inv_freq_ptr, q_out_ptr, cos_ptr, sin_ptr, ring_ptr, slots_ptr,
                             pos_ptr, valid_ptr, num_new_ptr, stride_qt, stride_kvt, S, W, scratch_slot, eps,
                             H: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
                             INTERPRETED: tl.constexpr):
        """Program (t, c): query heads c BLOCK_H ... of token t, or (c past them) t's key into the ring
        and its cos / sin out."""
        t = tl.program_id(0).to(tl.int64)
        h0 = tl.program_id(1) * BLOCK_H
        cols = tl.arange(0, D)
        pair = tl.arange(0, D // 2)
        turns = 2 * pair >= D - ROPE
        position = tl.load(pos_ptr + t + tl.zeros((1,), tl.int64))
        cos, sin = _cos_sin(position, inv_freq_ptr, pair - (D - ROPE) // 2, turns)
        if h0 < H:
            heads = h0 + tl.arange(0, BLOCK_H)
            ok = (heads < H)[:, None]
            # (the branches' names differ: Triton wants a name's type the same after both)
            q = tl.load(q_ptr + t * stride_qt + heads[:, None] * D + cols[None, :], mask=ok, other=0.0)
            q = _normed_rotated(q.to(tl.float32), None, cos, sin, eps, BLOCK_H, D, ROPE, False, INTERPRETED)
            tl.store(q_out_ptr + (t * H + heads[:, None]) * D + cols[None, :], q, mask=ok)
        else:
            k = tl.load(kv_ptr + t * stride_kvt + cols[None, :]).to(tl.float32)
            w = tl.load(w_ptr + cols).to(tl.float32)
            k = _normed_rotated(k, w, cos, sin, eps, 1, D, ROPE, True, INTERPRETED)
            # write_window's rule: of a sequence's new tokens only the last W survive in the ring
            n, s = t // S, t % S
            keep = (tl.load(valid_ptr + t) != 0) & (s >= tl.load(num_new_ptr + n) - W)
            row = tl.where(keep, tl.load(slots_ptr + n), scratch_slot).to(tl.int64)
            index = tl.where(keep, tl.load(pos_ptr + t) % W, 0).to(tl.int64)
            tl.store(ring_ptr + (row * W + index) * D + cols[None, :], k)
            half = t * (ROPE // 2) + pair[None, :] - (D - ROPE) // 2
            tl.store(cos_ptr + half, cos, mask=turns[None, :])
            tl.store(sin_ptr + half, sin, mask=turns[None, :])

    @torch.library.triton_op("lockstep::qk_norm_rope_step", mutates_args=("ring",))
    def qk_norm_rope_step(q: torch.Tensor, kv: torch.Tensor, kv_weight: torch.Tensor, inv_freq: torch.Tensor,
                          eps: float, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                          valid: torch.Tensor, num_new: torch.Tensor,
                          scratch_slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, S, H, D] (q_b's output), kv [N, S, D] (kv_proj's, any row stride), kv_weight [D]
        (kv_norm's), inv_freq [ROPE / 2] fp32 (the layer's rotary frequencies), the ring [slots, W, D]
        and the step's slots [N], positions / valid [N, S], num_new [N] (StepBatch's) -> the queries
        [N, S, H, D] and the rotation's cos, sin [N, S, ROPE / 2] fp32 (rope_cos_sin's: the output's
        rotation back takes them); the keys are written into the ring (window_ring.write_window's places)."""
        N, S, H, D = q.shape
        T, W = N * S, ring.shape[1]
        q = q.reshape(T, H, D).contiguous()
        kv = kv.reshape(T, D)
        kv = kv if kv.stride(-1) == 1 else kv.contiguous()
        out = torch.empty_like(q)
        cos, sin = (inv_freq.new_empty(N, S, inv_freq.shape[0]) for _ in range(2))
        if T:
            torch.library.wrap_triton(_qk_norm_rope_kernel)[(T, triton.cdiv(H, BLOCK_H) + 1)](
                q, kv, kv_weight.contiguous(), inv_freq.contiguous(), out, cos, sin, ring, slots.contiguous(),
                positions.contiguous(), valid.contiguous(), num_new.contiguous(), q.stride(0), kv.stride(0),
                S, W, scratch_slot, eps, H=H, D=D, ROPE=2 * inv_freq.shape[0], BLOCK_H=BLOCK_H,
                INTERPRETED=_gt.interpreted(), num_warps=4)
        return out.view(N, S, H, D), cos, sin

    # shapes for torch.compile's tracing, written out (step_attention_triton.py says why)
    @qk_norm_rope_step.register_fake
    def _(q, kv, kv_weight, inv_freq, eps, ring, slots, positions, valid, num_new, scratch_slot):
        return q.new_empty(q.shape), *(inv_freq.new_empty(*q.shape[:2], inv_freq.shape[0]) for _ in range(2))
