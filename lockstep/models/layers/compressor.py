"""KV compressor of DeepSeek-V4's hybrid attention: one entry per closed block of m tokens.

Each token t yields kv_t = W_kv h_t and gate_t = W_gate h_t + position_bias[t mod m].
- Plain (C128, `overlap=False`): entry j = Norm( sum_{t in block j} softmax_t(gate_t) * kv_t ),
  the softmax taken per channel over the block's tokens.
- Overlapping (C4, `overlap=True`): kv and gate have 2*D channels; the first half (Ca) of a
  block's tokens feeds the NEXT block's entry and the second half (Cb) feeds its own, so entry
  j pools 2m slots: block j-1's Ca then block j's Cb. Before block 0 the slots are kv=0,
  gate=-inf (softmax weight 0).
RoPE (compress frequencies) rotates the entry's trailing dims at the block start j*m.
A query at position p may use entry j only once block j has closed: j < floor((p+1)/m).

Two callers share `entries_from_blocks`: `forward_full` over whole sequences (training) and
`forward_step` over a chunk of new tokens with per-slot state (rollout): the open block's
raw kv/gate (`buf_*`) and, for C4, the last closed block's Ca half (`prev_*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import compiled_rows, compressor_step_triton, pool_slots_triton
from .kernel_switch import Switched
from .norm import RMSNorm
from .row_blocks import in_rows_forward, row_blocks
from .rope import apply_rope, rope_cos_sin
from .whole_rows import in_whole_rows, row_local


class Compressor(Switched, nn.Module):
    def __init__(self, hidden_size: int, head_dim: int, compress_rate: int, overlap: bool, norm_eps: float):
        super().__init__()
        self.m, self.head_dim, self.overlap = compress_rate, head_dim, overlap
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(compress_rate, width))
        self.kv_norm = RMSNorm(head_dim, eps=norm_eps)

    @property
    def width(self) -> int:
        return self.kv_proj.out_features

    def block_slots(self, kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None,
                    prev_gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """kv/gate [N, nb, m, width] with position bias added -> each entry's pooled slots [N, nb, slots, D]
        (C4: 2m slots, block j-1's Ca half then block j's Cb half; C128: the block's m tokens).
        prev_kv/prev_gate [N, m, D]: Ca half of the block before block 0 (C4 only; None = none).
        """
        if not self.overlap:
            return kv, gate
        d = self.head_dim
        ca_kv, ca_gate = kv[..., :d], gate[..., :d]
        if prev_kv is None:
            prev_kv = torch.zeros_like(ca_kv[:, 0])
            prev_gate = torch.full_like(ca_gate[:, 0], float("-inf"))
        shifted_kv = torch.cat([prev_kv.unsqueeze(1).to(kv.dtype), ca_kv[:, :-1]], dim=1)
        shifted_gate = torch.cat([prev_gate.unsqueeze(1).to(gate.dtype), ca_gate[:, :-1]], dim=1)
        return torch.cat([shifted_kv, kv[..., d:]], dim=2), torch.cat([shifted_gate, gate[..., d:]], dim=2)

    @staticmethod
    def pool_slots(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """[..., slots, D] -> [..., D]: softmax over the slots per channel, weighted sum (pre-norm)."""
        weights = gate.softmax(dim=-2, dtype=torch.float32).to(kv.dtype)
        return (kv * weights).sum(dim=-2)

    def entries_from_blocks(self, kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None,
                            prev_gate: torch.Tensor | None, block_starts: torch.Tensor,
                            inv_freq: torch.Tensor) -> torch.Tensor:
        """Blocks [N, nb, m, width] (position bias added) -> finished entries [N, nb, D]."""
        return self.entries_from_slots(*self.block_slots(kv, gate, prev_kv, prev_gate), block_starts, inv_freq)

    def entries_from_slots(self, kv: torch.Tensor, gate: torch.Tensor, block_starts: torch.Tensor,
                           inv_freq: torch.Tensor) -> torch.Tensor:
        """Each entry's slots [N, nb, slots, D] (block_slots) -> finished entries [N, nb, D]. In the
        true-on-policy forward the entries are pooled and finished in row blocks (row_blocks.py), or
        over whole rows by the pooling kernel, the fixed-order norm and the RoPE (`_pool_and_finish`,
        compiled under compile_rows for training and every engine step alike), so an entry has the
        same bits whether training pooled a whole sequence or a decode step closed its block."""
        N, nb = kv.shape[:2]
        if in_whole_rows() and pool_slots_triton.available(kv):  # every entry in one call (whole_rows.py)
            # cos / sin eager on both sides: an argument derived from inv_freq would make its size a symbol
            cos, sin = rope_cos_sin(inv_freq, block_starts.flatten())
            rows = row_local(True, _pool_and_finish, kv.flatten(0, 1), gate.flatten(0, 1), cos, sin, owner=self)
            return rows.view(N, nb, -1)
        if not in_rows_forward():
            return self.finish(self.pool_slots(kv, gate), *rope_cos_sin(inv_freq, block_starts))
        entries = row_blocks(lambda k, g, s: self.finish(self.pool_slots(k, g), *rope_cos_sin(inv_freq, s)),
                             kv.flatten(0, 1), gate.flatten(0, 1), block_starts.flatten())
        return entries.view(N, nb, -1)

    def closed_entries(self, positions: torch.Tensor) -> torch.Tensor:
        """How many entries a query at each position may use: block j has closed once j < (p + 1) // m."""
        return (positions + 1) // self.m

    def finish(self, pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Norm, then RoPE at each entry's block start. pooled [..., D], cos / sin [..., rope_dim / 2]
        (rope_cos_sin of the block starts)."""
        return apply_rope(self.kv_norm(pooled), cos, sin, self.kernels.on("triton_rope"))

    def forward_full(self, kv: torch.Tensor, gate: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """kv, gate [B, S, width] (kv_proj(h), gate_proj(h)) from position 0 -> entries
        [B, S // m, D] of every closed block."""
        B, S, _ = kv.shape
        nb = S // self.m
        if nb == 0:  # shorter than one block: nothing has closed yet
            return kv.new_zeros(B, 0, self.head_dim)
        kv = kv[:, : nb * self.m].reshape(B, nb, self.m, -1)
        gate = gate[:, : nb * self.m].reshape(B, nb, self.m, -1) + self.position_bias
        starts = (torch.arange(nb, device=kv.device) * self.m).expand(B, nb)
        return self.entries_from_blocks(kv, gate, None, None, starts, inv_freq)

    def forward_step(self, kv_new: torch.Tensor, gate_new: torch.Tensor, start_pos: torch.Tensor,
                     num_new: torch.Tensor, state: "CompressorState", slots: torch.Tensor,
                     inv_freq: torch.Tensor) -> None:
        """Feed new tokens' kv_proj / gate_proj outputs [N, S, width] (row i: num_new[i] valid
        tokens from start_pos[i]) into the per-slot state; every block that closes writes its
        entry to state.entries. A decode step's block layout and state writes go through their
        compiled forms under compile_rows (compiled_rows.decode_call): data movement, integer
        arithmetic and one add, the same values compiled or not; the entries' own arithmetic
        (entries_from_slots) runs as the training forward runs it."""
        S = kv_new.shape[1]
        if compressor_step_triton.runs(kv_new, self.kernels.on("triton_compressor")):
            return self.decode_step(kv_new[:, 0], gate_new[:, 0], start_pos, num_new, state, slots, inv_freq)
        buffers = (state.buf_kv, state.buf_gate, state.prev_kv, state.prev_gate)
        kv_b, raw_gate_b, gate_b, slot_kv, slot_gate, starts, first_block, closed = compiled_rows.decode_call(
            S, _step_blocks, self, kv_new, gate_new, start_pos, num_new, slots, *buffers)
        entries = self.entries_from_slots(slot_kv, slot_gate, starts, inv_freq)
        compiled_rows.decode_call(S, _write_state, self, slots, kv_b, raw_gate_b, gate_b, entries, first_block, closed,
                                  state.scratch_slot, state.entries, *buffers)

    def decode_step(self, kv_new: torch.Tensor, gate_new: torch.Tensor, start_pos: torch.Tensor, num_new: torch.Tensor,
                    state: "CompressorState", slots: torch.Tensor, inv_freq: torch.Tensor) -> None:
        """`forward_step` of one token per sequence (kv_new, gate_new [N, width]; num_new 1, or 0 for a
        padding row) by the kernel (compressor_step_triton.py): the entry each closing block makes,
        then only the token into the open block's buffers, the entry into `entries` and, where a block
        closed (C4), its Ca half into `prev_*`. A closed block's buffer is left as it is (the torch form
        empties it): its slots are written again before any entry reads them."""
        m, scratch = self.m, state.scratch_slot
        if compressor_step_triton.WRITES_STATE:  # all of it in the kernel
            compressor_step_triton.compressor_step(
                kv_new, gate_new, start_pos, num_new, slots, state.buf_kv, state.buf_gate, state.prev_kv,
                state.prev_gate, self.position_bias, self.kv_norm.weight, inv_freq, self.kv_norm.eps, state.entries,
                scratch)
            return
        cos, sin = rope_cos_sin(inv_freq, start_pos - (m - 1))  # the closing block's start
        entry = compressor_step_triton.closing_entry(
            kv_new, gate_new, start_pos, num_new, slots, state.buf_kv, state.buf_gate, state.prev_kv, state.prev_gate,
            self.position_bias, self.kv_norm.weight, cos, sin, self.kv_norm.eps)
        fill, has_token = start_pos % m, num_new > 0
        closes = has_token & (fill == m - 1)
        rows = torch.where(has_token, slots, scratch)
        state.buf_kv[rows, fill] = kv_new.to(state.buf_kv.dtype)
        state.buf_gate[rows, fill] = gate_new.to(state.buf_gate.dtype)
        closed_rows = torch.where(closes, slots, scratch)  # as the token writes: the others go to the scratch slot
        state.entries[closed_rows, torch.where(closes, start_pos // m, 0)] = entry
        if self.overlap:  # the closed block (its token now written) becomes the next entry's Ca half
            d = self.head_dim
            state.prev_kv[closed_rows] = state.buf_kv[slots, :, :d]
            state.prev_gate[closed_rows] = (state.buf_gate[slots, :, :d] + self.position_bias[:, :d]).to(
                state.prev_gate.dtype)


def _step_blocks(comp: Compressor, kv_new, gate_new, start_pos, num_new, slots, buf_kv, buf_gate, prev_kv, prev_gate):
    """A step's new tokens [N, S, width] laid out block-aligned after each slot's open block ->
    (kv, raw gate, gate + position bias [N, nb, m, width], each entry's slots (block_slots: kv, gate
    [N, nb, slots, D]), block starts [N, nb], first block [N], blocks closed by the step [N])."""
    N, S, _ = kv_new.shape
    m, dev = comp.m, kv_new.device
    fill = start_pos % m  # tokens already in the open block
    nb = (m + S + m - 1) // m
    # Column j holds new token j - fill when there is one, else the buffer (j < m) or zeros. A gather
    # and a select of fixed shape (no nonzero, so no device sync).
    src = torch.arange(nb * m, device=dev).unsqueeze(0) - fill.unsqueeze(1)
    take = ((src >= 0) & (src < num_new.unsqueeze(1))).unsqueeze(-1)
    src = src.clamp(0, S - 1).unsqueeze(-1).expand(N, nb * m, comp.width)
    tail = (0, 0, 0, (nb - 1) * m)
    kv = torch.where(take, kv_new.gather(1, src), F.pad(buf_kv[slots].to(kv_new.dtype), tail))
    gate = torch.where(take, gate_new.gather(1, src), F.pad(buf_gate[slots].to(gate_new.dtype), tail))
    kv_b, raw_gate_b = kv.view(N, nb, m, -1), gate.view(N, nb, m, -1)
    first_block = start_pos // m
    starts = (first_block.unsqueeze(1) + torch.arange(nb, device=dev)) * m
    prev = (prev_kv[slots], prev_gate[slots]) if comp.overlap else (None, None)
    gate_b = raw_gate_b + comp.position_bias
    return kv_b, raw_gate_b, gate_b, *comp.block_slots(kv_b, gate_b, *prev), starts, first_block, (fill + num_new) // m


def _pool_and_finish(comp: Compressor, kv: torch.Tensor, gate: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    """Entries' slots [R, slots, D] -> finished entries [R, D] over whole rows: the pooling kernel,
    the fixed-order norm, RoPE (cos / sin [R, rope_dim / 2])."""
    return comp.finish(pool_slots_triton.pool_slots(kv, gate), cos, sin)


def _write_state(comp: Compressor, slots, kv_b, raw_gate_b, gate_b, entries, first_block, closed, scratch_slot: int,
                 entries_buf, buf_kv, buf_gate, prev_kv, prev_gate) -> None:
    """The step's entries and the slots' new open blocks (and Ca halves) into the state's buffers."""
    N, nb = entries.shape[:2]
    b = torch.arange(nb, device=entries.device)
    done = b.unsqueeze(0) < closed.unsqueeze(1)
    # all [N, nb] entries are written (fixed shape, no device sync); the open ones go to the scratch slot
    dest_slot = torch.where(done, slots.unsqueeze(1), scratch_slot)
    dest_entry = torch.where(done, first_block.unsqueeze(1) + b, 0)
    entries_buf[dest_slot, dest_entry] = entries.to(entries_buf.dtype)
    open_rows = torch.arange(N, device=entries.device)
    # the block left open becomes the buffer (raw gate: bias is re-added at pooling)
    buf_kv[slots] = kv_b[open_rows, closed].to(buf_kv.dtype)
    buf_gate[slots] = raw_gate_b[open_rows, closed].to(buf_gate.dtype)
    if comp.overlap:
        d = comp.head_dim
        moved = closed > 0
        last = (closed - 1).clamp(min=0)
        new_prev_kv = kv_b[open_rows, last, :, :d]
        new_prev_gate = gate_b[open_rows, last, :, :d]
        keep = ~moved.view(N, 1, 1)
        prev_kv[slots] = torch.where(keep, prev_kv[slots], new_prev_kv.to(prev_kv.dtype))
        prev_gate[slots] = torch.where(keep, prev_gate[slots], new_prev_gate.to(prev_gate.dtype))


class CompressorState:
    """Per-slot rollout state of one compressor: closed entries and the open block.

    entries [slots, max_entries, D]; buf_kv/buf_gate [slots, m, width] hold the open block's
    raw projections (gate without position bias); prev_kv/prev_gate [slots, m, D] hold the Ca
    half of the last closed block (C4 only; gate with bias, fp32, -inf before the first block).
    """

    def __init__(self, num_slots: int, max_entries: int, comp: Compressor, dtype, device):
        m, d, w = comp.m, comp.head_dim, comp.width
        self.entries = torch.empty(num_slots, max_entries, d, dtype=dtype, device=device)
        self.buf_kv = torch.empty(num_slots, m, w, dtype=dtype, device=device)
        self.buf_gate = torch.empty(num_slots, m, w, dtype=dtype, device=device)
        self.prev_kv = torch.empty(num_slots, m, d, dtype=dtype, device=device) if comp.overlap else None
        # fp32 whatever the cache dtype: the position bias (kept in fp32) is already added, and a
        # training forward pools the same gates unrounded
        self.prev_gate = torch.empty(num_slots, m, d, dtype=torch.float32, device=device) if comp.overlap else None
        for t, value in self.initial_values():  # every slot empty
            t.fill_(value)

    @property
    def scratch_slot(self) -> int:
        return self.entries.shape[0] - 1

    def initial_values(self) -> list[tuple[torch.Tensor, float]]:
        """Each state tensor and the value an empty slot holds (the gates' running max starts at -inf)."""
        values = [(self.entries, 0.0), (self.buf_kv, 0.0), (self.buf_gate, 0.0)]
        if self.prev_kv is not None:
            values += [(self.prev_kv, 0.0), (self.prev_gate, float("-inf"))]
        return values

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.entries, self.buf_kv, self.buf_gate, self.prev_kv, self.prev_gate) if t is not None]
