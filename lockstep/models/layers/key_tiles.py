"""Attention over keys in position-ordered tiles: the true-on-policy forward's attention core.

The default attention (sink_attention.py) scores a query against whatever key tensor its caller
built: the whole sequence plus every compressed entry in training, the window ring plus the new
tokens plus the cached entries in a decode step. The softmax sums and the probabilities x values
sums then run over different lengths in different orders, so a token's output differs in the last
bits between the trainer and the engine. Here every query reads the same keys in the same order
whoever asks:

- tile 0: its sliding window, slot j holding position p - W + 1 + j (slots before position 0
  masked);
- then the compressed entries 0, 1, 2, ... in tiles of ENTRY_TILE, masked where not visible or,
  in C4 layers, not picked by the indexer.

An online softmax walks the tiles in that order, the sink folded in first as an entry of value 0
(running max = sink, running sum = 1). A tile whose keys are all masked changes nothing, bit for
bit (max unchanged, rescale factor exp(0) = 1, zero added), so a caller may pass more entry
tiles than a query can see: the trainer's entry count (its batch's length / m) and the engine's
(its cache capacity) differ, the results do not. Masked keys are zeroed, so whatever a gather
read there (another sequence's entries, a stale cache row) adds exact zeros.

Called inside row blocks (row_blocks.py), so the bmm shapes are [ROWS, ...] on every side.
"""

from __future__ import annotations

import torch

ENTRY_TILE = 64


def tile_spans(num_entries: int) -> list[tuple[int, int]]:
    """(start, stop) of each ENTRY_TILE-wide tile over entries [0, num_entries); the last tile
    keeps its full width (the caller masks what lies past num_entries)."""
    return [(s, s + ENTRY_TILE) for s in range(0, num_entries, ENTRY_TILE)]


def gather_tile(source: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """source [M, D] rows, index [R, T] (any value where not valid) -> [R, T, D], zero where not valid."""
    rows = source[index.clamp(0, max(source.shape[0] - 1, 0))]
    return torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def tiled_sink_attention(q: torch.Tensor, tiles: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """q [R, H, D]; tiles [(keys [R, T, D] zero where masked, valid [R, T])] in position order;
    sinks [H] -> [R, H, D] in q's dtype. K = V (DeepSeek-V4's shared KV head)."""
    R, H, D = q.shape
    running_max = sinks.float().unsqueeze(0).expand(R, H).contiguous()
    running_sum = torch.ones(R, H, device=q.device)
    acc = torch.zeros(R, H, D, device=q.device)
    for keys, valid in tiles:
        scores = torch.bmm(q, keys.transpose(1, 2)).float() * scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1))
        rescale = torch.exp(running_max - new_max)
        probs = torch.exp(scores - new_max.unsqueeze(-1))
        running_sum = running_sum * rescale + probs.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.bmm(probs.to(keys.dtype), keys).float()
        running_max = new_max
    return (acc / running_sum.unsqueeze(-1)).to(q.dtype)


def tiled_index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores over one tile (indexer.py's formula, shapes fixed by the tile):
    q [R, H_I, D_I] (roped), head_weights [R, H_I] (already scaled by H_I^-0.5), keys [R, T, D_I]
    -> [R, T] fp32 = sum_h w_h * ReLU(q_h . k) * D_I^-0.5."""
    dots = torch.relu(torch.bmm(q.float(), keys.float().transpose(1, 2))) * q.shape[-1] ** -0.5
    return (dots * head_weights.float().unsqueeze(-1)).sum(dim=1)
