"""The sliding window's ring cache: position p of a sequence lives at ring index p % W of its slot,
and the ring has one extra scratch slot (LayerCache.scratch_slot) that absorbs masked-out writes.
The default decode step (DeepseekV4Attention.forward_step) reads and writes it here, as does the
true-on-policy one (attention_rows.StepKeys), which compiles its reads and writes for decode steps
(compiled_rows.decode_call): module functions, one compilation for every layer."""

from __future__ import annotations

import torch


def read_window(ring: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rings of sequences `slots` [N] before a step whose first new token is at start_pos [N] ->
    (keys [N, W, D], the position each ring index holds [N, W]; < 0: empty)."""
    W = ring.shape[1]
    last = (start_pos - 1).unsqueeze(1)  # last position already in the ring
    r = torch.arange(W, device=last.device)
    return ring[slots], last - torch.remainder(last - r, W)


def write_window(ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                 num_new: torch.Tensor, kv: torch.Tensor, scratch_slot: int) -> None:
    """A step's new keys kv [N, S, D] (positions, valid [N, S]; num_new [N]) into the ring [slots + 1,
    W, D] of sequences `slots` [N]; writes that do not survive go to scratch_slot."""
    W = ring.shape[1]
    # only the last W new tokens survive; writing just those keeps ring indices unique
    t = torch.arange(kv.shape[1], device=kv.device)
    keep = valid & (t.unsqueeze(0) >= (num_new - W).unsqueeze(1))
    # every [N, S] token is written (fixed shape, no nonzero: no device sync); the dropped ones
    # land in the scratch slot
    rows = torch.where(keep, slots.unsqueeze(1), scratch_slot)
    ring_index = torch.where(keep, positions % W, 0)
    ring[rows, ring_index] = kv.to(ring.dtype)


def window_keys(ring, slots, new, start_pos, sequence, key_pos):
    """The true-on-policy step's window keys, as rows: ring [slots, W, D], new tokens [N, S, D] ->
    (source [N (W + S), D]: each sequence's ring then its new tokens, index and valid [T, W] into
    it): positions before the step's first new token come from the ring (position q at ring index
    q mod W), the others from the new tokens. Data movement and integer arithmetic only: compiled
    or not, the same values."""
    W, S = ring.shape[1], new.shape[1]
    source = torch.cat([ring[slots].to(new.dtype), new], dim=1).flatten(0, 1)
    start = start_pos[sequence].unsqueeze(1)
    within = torch.where(key_pos < start, torch.remainder(key_pos, W), W + key_pos - start)
    return source, (sequence * (W + S)).unsqueeze(1) + within, key_pos >= 0
