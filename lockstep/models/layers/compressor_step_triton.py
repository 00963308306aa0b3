"""The compressed entry a decode step closes, as one Triton kernel reading the compressor's open
block where it is cached, registered as the custom op `lockstep::closing_entry`.

What (compressor.py has the formulas): at a decode step each sequence adds one token to its open
block of m; the token at position p closes the block when p % m = m - 1. For such a sequence the
kernel pools the block's slots (C128: its m tokens; C4: the previous block's Ca half from
`prev_*`, then this block's Cb half) with a per-channel softmax over the slots, normalises the
pooled row (kv_norm) and rotates its trailing rope channels at the block start p - m + 1; the
block's first m - 1 tokens come from the state's buffers (buf_kv / buf_gate, raw gates: the
position bias is added here), the last is the step's own token. A sequence whose block stays
open gets a row of zeros (Compressor.forward_step sends it to the scratch slot).

Why: the torch form of a decode step laid out two whole blocks per sequence (its open block
gathered from the buffers, padded by an empty one), pooled, normed and rotated both, and wrote
the open block back whole: for a C128 layer ~12 MB of copies a step at batch 64 and ~10 launches
per compressor (two in each C4 layer: the attention's and the indexer's), although a block closes
once in m steps. Here a sequence whose block stays open costs one store, and
Compressor.forward_step writes only the step's token into the buffer. Measured on one H200
(2026-12-03, rollout_throughput.py --config 1b --batch 64 --step-trace): turned on together with the
router kernel, the step went 383 -> 348 kernels and 1,645 -> 1,553 us of device time, of which the
router's kernel added ~57 us, so ~150 us saved; this kernel is 1.1-1.5 us a call.

Numerics, as the torch form rounds (bf16): the gate + position bias rounded to the gate's dtype;
the softmax over the slots in fp32, the weights rounded to kv's dtype, each product kv * weight
rounded to kv's dtype and the products summed in fp32, rounded once (the pooled row); the norm in
fp32 (weight * (x * rsqrt(mean(x^2) + eps))), rounded; the rotation in fp32 of the rounded normed
values, rounded. The softmax's and the pooled sum's order differ from torch's: equal to the torch
form to a bf16 ulp, not bitwise (tests/models/test_compressor_step_triton.py).

`lockstep::compressor_step` (WRITES_STATE, on by default) is the same kernel doing all of
Compressor.decode_step: the block start's cos / sin from the layer's frequencies (libdevice's, as
inductor's kernel computes them), the entry written into the state's entries, the token into the
open block's buffers and, where a C4 block closes, its Ca half into prev_*.

Where: Compressor.forward_step at a decode step (one new token per sequence) on CUDA without
gradients, under the triton_compressor switch (kernel_switch.py; off in the true-on-policy forward,
whose entries must be the training forward's bits). Forward only. Testable on CPU with
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt
from . import rope_triton
from .kernel_switch import forward_kernel_allowed

triton = _gt.triton
if triton is not None:
    import triton.language as tl

SLOT_BLOCK = 32  # slots per tile: a C128 block is four

# Compressor.decode_step through `compressor_step`: the same kernel also computes the block start's
# cos / sin and makes the state's writes (the token into the open block's buffers, the entry, C4's
# Ca half into prev_*), where the step ran inductor's cos / sin kernel and two scatter kernels after
# it (1.4-2.4 us each, a compressor call; 9 calls a 1b step). CPU-tested (the same state, bit for bit
# where data only moves) and compiled to sm_90. On one H200 (rollout_throughput.py --config 1b, bf16,
# one call, 2026-12-05): a decode step of 163 kernels and 1,198 us against 178 and 1,229 without it,
# decode 52,012 tok/s against 51,036.
WRITES_STATE = True


def runs(kv_new: torch.Tensor, enabled: bool) -> bool:
    """Whether a step's new tokens kv_new [N, S, width] close their entries by the kernel (module docstring)."""
    return triton is not None and forward_kernel_allowed(enabled, kv_new) and kv_new.shape[1] == 1


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _bf16, _cos_sin = _gt._bf16, rope_triton._cos_sin

    @triton.jit
    def _write_state(n, slot, p, has_token, closes, kv_new_ptr, gate_new_ptr, buf_kv_ptr, buf_gate_ptr, prev_kv_ptr,
                     prev_gate_ptr, bias_ptr, W, D, scratch_slot, stride_kn, stride_gn, stride_bs, stride_bt, stride_ps,
                     stride_pt, stride_bias, M: tl.constexpr, OVERLAP: tl.constexpr, MP: tl.constexpr,
                     WP: tl.constexpr, BIAS_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """Compressor.decode_step's state writes for sequence n: its token into the open block's
        buffers (row `slot`, or the scratch slot without a token), and where its block closes (C4)
        the block's Ca half, its first D channels, into prev_*: kv as it is, gate + position bias
        (a bf16 add where the bias is bf16, as torch adds them), in prev_*'s dtypes. The closed
        block's first M - 1 tokens are read from the buffers, unchanged by the token's write."""
        rw = tl.arange(0, WP)
        w_ok = rw < W
        row = tl.where(has_token, slot, scratch_slot).to(tl.int64)
        at = row * stride_bs + (p % M) * stride_bt + rw
        tl.store(buf_kv_ptr + at, tl.load(kv_new_ptr + n * stride_kn + rw, mask=w_ok), mask=w_ok)
        tl.store(buf_gate_ptr + at, tl.load(gate_new_ptr + n * stride_gn + rw, mask=w_ok), mask=w_ok)
        if OVERLAP:
            if closes:
                t = tl.arange(0, MP)[:, None]
                ch = tl.arange(0, WP)[None, :]
                ok = (t < M) & (ch < D)
                from_buf = ok & (t < M - 1)
                last = ok & (t == M - 1)
                kv = tl.load(buf_kv_ptr + slot * stride_bs + t * stride_bt + ch, mask=from_buf, other=0.0)
                kv = tl.where(last, tl.load(kv_new_ptr + n * stride_kn + ch + 0 * t, mask=last, other=0.0), kv)
                raw = tl.load(buf_gate_ptr + slot * stride_bs + t * stride_bt + ch, mask=from_buf, other=0.0)
                raw = tl.where(last, tl.load(gate_new_ptr + n * stride_gn + ch + 0 * t, mask=last, other=0.0), raw)
                gate = raw.to(tl.float32) + tl.load(bias_ptr + t * stride_bias + ch, mask=ok, other=0.0).to(tl.float32)
                if BIAS_BF16:
                    gate = _bf16(gate, INTERPRETED).to(tl.float32)
                prev = slot * stride_ps + t * stride_pt + ch
                tl.store(prev_kv_ptr + prev, kv.to(prev_kv_ptr.dtype.element_ty), mask=ok)
                tl.store(prev_gate_ptr + prev, gate.to(prev_gate_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _slot_tile(s, c, c_ok, kv_new_row, gate_new_row, buf_kv_row, buf_gate_row, prev_kv_row, prev_gate_row,
                   bias_ptr, D, stride_bt, stride_pt, stride_bias, M: tl.constexpr, OVERLAP: tl.constexpr,
                   BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """Slots s [SB] of the closing entry at channels c [H, 2] -> (kv, gate) [SB, H, 2] in fp32,
        gate -inf where there is no slot. Slot order: C4 the previous block's Ca half (s < M), then
        the block's Cb half; C128 the block's tokens."""
        s3 = s[:, None, None]
        if OVERLAP:
            from_prev = s3 < M
            t = tl.where(from_prev, s3, s3 - M)  # the token within its block
            ch = tl.where(from_prev, c[None], c[None] + D)  # the block's Cb half: channels D .. 2D
            in_slots = s3 < 2 * M
        else:
            from_prev = s3 < 0
            t = s3
            ch = c[None] + 0 * s3
            in_slots = s3 < M
        ok = in_slots & c_ok[None]
        own = ok & ~from_prev
        is_new = own & (t == M - 1)
        from_buf = own & (t < M - 1)
        kv = tl.load(buf_kv_row + t * stride_bt + ch, mask=from_buf, other=0.0)
        kv = tl.where(is_new, tl.load(kv_new_row + ch, mask=is_new, other=0.0), kv)
        raw = tl.load(buf_gate_row + t * stride_bt + ch, mask=from_buf, other=0.0)
        raw = tl.where(is_new, tl.load(gate_new_row + ch, mask=is_new, other=0.0), raw)
        gate = raw.to(tl.float32) + tl.load(bias_ptr + t * stride_bias + ch, mask=own, other=0.0).to(tl.float32)
        if BF16:  # gate_b = raw gate + position bias, a bf16 add
            gate = _bf16(gate, INTERPRETED).to(tl.float32)
        if OVERLAP:  # prev_*: the last closed block's Ca half, gate already biased (fp32 of bf16 values)
            prev_ok = ok & from_prev
            kv = tl.where(prev_ok, tl.load(prev_kv_row + t * stride_pt + c[None], mask=prev_ok,
                                           other=0.0), kv)
            gate = tl.where(prev_ok, tl.load(prev_gate_row + t * stride_pt + c[None],
                                             mask=prev_ok, other=0.0), gate)
        return kv.to(tl.float32), tl.where(ok, gate, float("-inf"))

    @triton.jit
    def _closing_entry_kernel(kv_new_ptr, gate_new_ptr, pos_ptr, num_new_ptr, slots_ptr, buf_kv_ptr, buf_gate_ptr,
                              prev_kv_ptr, prev_gate_ptr, bias_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, D, ROPE_HALF,
                              eps, stride_kn, stride_gn, stride_bs, stride_bt, stride_ps, stride_pt, stride_bias,
                              stride_cn, stride_on, W, scratch_slot, stride_ee,
                              M: tl.constexpr, OVERLAP: tl.constexpr, HALF: tl.constexpr,
                              SB: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr,
                              WRITE: tl.constexpr, MP: tl.constexpr, WP: tl.constexpr, BIAS_BF16: tl.constexpr):
        """Sequence n's closing entry into out[n] (zeros where its block stays open). WRITE
        (`compressor_step`): cos / sin of the block start computed here from inv_freq (at cos_ptr),
        out is the state's entries [slots, E, D] (written at [slot, p // M] where a block closes,
        nothing otherwise), and the state's other writes follow (`_write_state`)."""
        SLOTS: tl.constexpr = 2 * M if OVERLAP else M
        n = tl.program_id(0).to(tl.int64)
        eps = tl.cast(eps, tl.float32)
        ri = tl.arange(0, HALF)
        c = 2 * ri[:, None] + tl.arange(0, 2)[None, :]  # channel pairs (2i, 2i + 1): RoPE's pairs
        c_ok = c < D
        p = tl.load(pos_ptr + n)
        has_token = tl.load(num_new_ptr + n) > 0
        closes = has_token & (p % M == M - 1)
        slot = tl.load(slots_ptr + n).to(tl.int64)
        if closes:
            kv_new_row, gate_new_row = kv_new_ptr + n * stride_kn, gate_new_ptr + n * stride_gn
            buf_kv_row, buf_gate_row = buf_kv_ptr + slot * stride_bs, buf_gate_ptr + slot * stride_bs
            prev_kv_row, prev_gate_row = prev_kv_ptr + slot * stride_ps, prev_gate_ptr + slot * stride_ps
            rs = tl.arange(0, SB)
            # softmax over the slots per channel: the max, the sum, then the weighted kv
            mx = tl.full((HALF, 2), float("-inf"), dtype=tl.float32)
            for s0 in range(0, SLOTS, SB):
                _, gate = _slot_tile(s0 + rs, c, c_ok, kv_new_row, gate_new_row, buf_kv_row, buf_gate_row,
                                     prev_kv_row, prev_gate_row, bias_ptr, D, stride_bt, stride_pt, stride_bias, M,
                                     OVERLAP, BF16, INTERPRETED)
                mx = tl.maximum(mx, tl.max(gate, axis=0))
            total = tl.zeros((HALF, 2), dtype=tl.float32)
            for s0 in range(0, SLOTS, SB):
                _, gate = _slot_tile(s0 + rs, c, c_ok, kv_new_row, gate_new_row, buf_kv_row, buf_gate_row,
                                     prev_kv_row, prev_gate_row, bias_ptr, D, stride_bt, stride_pt, stride_bias, M,
                                     OVERLAP, BF16, INTERPRETED)
                total += tl.sum(tl.exp(gate - mx[None]), axis=0)
            acc = tl.zeros((HALF, 2), dtype=tl.float32)
            for s0 in range(0, SLOTS, SB):
                kv, gate = _slot_tile(s0 + rs, c, c_ok, kv_new_row, gate_new_row, buf_kv_row, buf_gate_row,
                                      prev_kv_row, prev_gate_row, bias_ptr, D, stride_bt, stride_pt, stride_bias, M,
                                      OVERLAP, BF16, INTERPRETED)
                w = tl.exp(gate - mx[None]) / total[None]
                if BF16:  # the weights and each product in kv's dtype
                    acc += tl.sum(_bf16(kv * _bf16(w, INTERPRETED).to(tl.float32), INTERPRETED).to(tl.float32),
                                  axis=0)
                else:
                    acc += tl.sum(kv * w, axis=0)
            x = _bf16(acc, INTERPRETED).to(tl.float32) if BF16 else acc
            # kv_norm: weight * (x * rsqrt(mean(x^2) + eps)), rounded
            r = tl.math.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / D + eps)
            y = tl.load(weight_ptr + c, mask=c_ok, other=0.0).to(tl.float32) * (x * r)
            if BF16:
                y = _bf16(y, INTERPRETED).to(tl.float32)
            # RoPE on the trailing ROPE_HALF pairs at the block start (cos / sin of that position)
            even, odd = tl.split(y)
            k = ri - (D // 2 - ROPE_HALF)
            rot = k >= 0
            if WRITE:  # rope_cos_sin at the block start p - M + 1 (inv_freq at cos_ptr)
                start = p - (M - 1) + tl.zeros((1,), tl.int64)
                cos, sin = _cos_sin(start, cos_ptr, k, rot)
                cos, sin = tl.reshape(cos, (HALF,)), tl.reshape(sin, (HALF,))
            else:
                cos = tl.load(cos_ptr + n * stride_cn + k, mask=rot, other=1.0)
                sin = tl.load(sin_ptr + n * stride_cn + k, mask=rot, other=0.0)
            y = tl.join(tl.where(rot, even * cos - odd * sin, even), tl.where(rot, odd * cos + even * sin, odd))
            if WRITE:
                entry = out_ptr + slot * stride_on + (p // M) * stride_ee + c
            else:
                entry = out_ptr + n * stride_on + c
            if BF16:
                tl.store(entry, _bf16(y, INTERPRETED), mask=c_ok)
            else:
                tl.store(entry, y.to(out_ptr.dtype.element_ty), mask=c_ok)
        elif not WRITE:
            tl.store(out_ptr + n * stride_on + c, tl.zeros((HALF, 2), dtype=out_ptr.dtype.element_ty), mask=c_ok)
        if WRITE:
            _write_state(n, slot, p, has_token, closes, kv_new_ptr, gate_new_ptr, buf_kv_ptr, buf_gate_ptr, prev_kv_ptr,
                         prev_gate_ptr, bias_ptr, W, D, scratch_slot, stride_kn, stride_gn, stride_bs, stride_bt,
                         stride_ps, stride_pt, stride_bias, M, OVERLAP, MP, WP, BIAS_BF16, INTERPRETED)

    @torch.library.triton_op("lockstep::closing_entry", mutates_args=())
    def closing_entry(kv_new: torch.Tensor, gate_new: torch.Tensor, start_pos: torch.Tensor, num_new: torch.Tensor,
                      slots: torch.Tensor, buf_kv: torch.Tensor, buf_gate: torch.Tensor, prev_kv: torch.Tensor | None,
                      prev_gate: torch.Tensor | None, position_bias: torch.Tensor, norm_weight: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
        """kv_new / gate_new [N, width] (the step's tokens at positions start_pos [N], num_new [N] of them:
        1, or 0 for a padding row) of sequences in state slots [N]; buf_kv / buf_gate [slots, m, width]
        (before the token is written), prev_kv / prev_gate [slots, m, D] (C4) or None; position_bias
        [m, width]; norm_weight [D]; cos / sin [N, rope_dim / 2] at the block starts -> the entries
        [N, D] (kv's dtype) of the blocks the tokens close, zeros where a block stays open."""
        out = kv_new.new_empty(kv_new.shape[0], norm_weight.shape[0])
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        _launch("closing_entry", kv_new, gate_new, start_pos, num_new, slots, buf_kv, buf_gate, prev_kv, prev_gate,
                position_bias, norm_weight, cos, sin, eps, out, cos.shape[1], cos.stride(0))
        return out

    def _launch(op, kv_new, gate_new, start_pos, num_new, slots, buf_kv, buf_gate, prev_kv, prev_gate, position_bias,
                norm_weight, cos, sin, eps, out, rope_half, stride_cn, scratch_slot=0):
        """The kernel's launch for both ops: `out` [N, D] the entries (closing_entry), or the state's
        entries [slots, E, D] with cos = inv_freq (compressor_step: WRITE)."""
        N, m, D = kv_new.shape[0], buf_kv.shape[1], norm_weight.shape[0]
        overlap, write = prev_kv is not None, out.dim() == 3
        for name, t in (("kv_new", kv_new), ("gate_new", gate_new), ("buf_kv", buf_kv), ("buf_gate", buf_gate),
                        ("position_bias", position_bias), ("prev_kv", prev_kv), ("prev_gate", prev_gate)):
            if t is not None and t.stride(-1) != 1:
                raise ValueError(f"{op}: {name} needs contiguous channels, got strides {t.stride()}")
        if buf_gate.stride() != buf_kv.stride() or (overlap and prev_gate.stride() != prev_kv.stride()):
            raise ValueError(f"{op}: the kv and gate buffers must share their layout")
        if not N:
            return
        prev_kv_t, prev_gate_t = (prev_kv, prev_gate) if overlap else (buf_kv, buf_gate)  # unread without C4
        W = kv_new.shape[1]
        torch.library.wrap_triton(_closing_entry_kernel)[(N,)](
            kv_new, gate_new, start_pos, num_new, slots, buf_kv, buf_gate, prev_kv_t, prev_gate_t, position_bias,
            norm_weight, cos, sin, out, D, rope_half, eps, kv_new.stride(0), gate_new.stride(0),
            buf_kv.stride(0), buf_kv.stride(1), prev_kv_t.stride(0), prev_kv_t.stride(1), position_bias.stride(0),
            stride_cn, out.stride(0), W, scratch_slot, out.stride(1) if write else 0, M=m, OVERLAP=overlap,
            HALF=triton.next_power_of_2(max(D // 2, 1)), SB=SLOT_BLOCK, BF16=kv_new.dtype == torch.bfloat16,
            INTERPRETED=_gt.interpreted(), WRITE=write, MP=triton.next_power_of_2(m), WP=triton.next_power_of_2(W),
            BIAS_BF16=position_bias.dtype == torch.bfloat16, num_warps=4)

    @torch.library.triton_op("lockstep::compressor_step",
                             mutates_args=("buf_kv", "buf_gate", "prev_kv", "prev_gate", "entries"))
    def compressor_step(kv_new: torch.Tensor, gate_new: torch.Tensor, start_pos: torch.Tensor, num_new: torch.Tensor,
                        slots: torch.Tensor, buf_kv: torch.Tensor, buf_gate: torch.Tensor, prev_kv: torch.Tensor | None,
                        prev_gate: torch.Tensor | None, position_bias: torch.Tensor, norm_weight: torch.Tensor,
                        inv_freq: torch.Tensor, eps: float, entries: torch.Tensor, scratch_slot: int) -> None:
        """Compressor.decode_step's work in one kernel (WRITES_STATE): closing_entry's entries (with the
        block start's cos / sin from inv_freq [rope_dim / 2] fp32) written into entries [slots, E, D] at
        [slot, position // m] where a block closes, the step's tokens into buf_kv / buf_gate (row the
        slot, or scratch_slot without a token), and where a C4 block closes its Ca half into prev_*."""
        _launch("compressor_step", kv_new, gate_new, start_pos, num_new, slots, buf_kv, buf_gate, prev_kv, prev_gate,
                position_bias, norm_weight, inv_freq.float().contiguous(), inv_freq, eps, entries, inv_freq.shape[0],
                0, scratch_slot)

    @compressor_step.register_fake
    def _(kv_new, gate_new, start_pos, num_new, slots, buf_kv, buf_gate, prev_kv, prev_gate, position_bias,
          norm_weight, inv_freq, eps, entries, scratch_slot):
        return None

    # shapes for torch.compile's tracing, written out (step_attention_triton.py says why)
    @closing_entry.register_fake
    def _(kv_new, gate_new, start_pos, num_new, slots, buf_kv, buf_gate, prev_kv, prev_gate, position_bias,
          norm_weight, cos, sin, eps):
        return kv_new.new_empty(kv_new.shape[0], norm_weight.shape[0])
