"""The true-on-policy attention of DeepSeek-V4 (deepseek_v4_rows.py says what "true on policy" is).

`attention_rows(attn, h, keys)` is DeepseekV4Attention.forward_rows: the layer input rows h [T, D]
-> the attention's output rows [T, D], in three steps, each in row blocks (row_blocks.py):
    projections (rows): q, kv, the compressors' projections, the indexer's query and head weights
    core (rows, keys gathered per row): window tile + compressed-entry tiles (key_tiles.py) -> o
    output (rows): RoPE undone, grouped low-rank output projection
With `whole_rows` (CUDA, whole_rows.py) the projections and the output run over every row in one
call with fixed-order GEMMs, the core as one kernel (tiled_attention_triton.py), the C4 layers'
entry picks from one more (index_scores_triton.py).
One method, so that data-parallel sharding (FSDP2) gathers the attention's weights once per layer
(lockstep/dist/fsdp.py registers it as a forward method).

Where keys come from is the caller's `keys` object, a `KeySource`: `FullSequences` (training: each
row's sequence, from position 0) or `StepKeys` (the engine: window ring + new tokens, the caches'
entries, and the cache writes a step makes). Rows are flat: b * S + p, or n * S + t for a step's
N x S new tokens.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from functools import partial

import torch

from ..deepseek_v4_config import CSA
from . import compiled_rows, index_scores_triton, tiled_attention_triton
from .key_tiles import ENTRY_TILE, gather_tile, tile_spans, tiled_index_scores, tiled_sink_attention
from .rope import rope_cos_sin
from .row_blocks import row_blocks
from .whole_rows import row_local, whole_rows as whole_rows_mode
from .window_ring import window_keys, write_window

REACH_GROUPS = 4  # position ranges of a training forward that each walk only the entry tiles they can see


class KeySource:
    """N sequences of S rows each (row n * S + t): where a row's keys come from. Subclasses say where
    the window's keys and the compressed entries live; the row layout and the window's slot
    positions (the same for every layer of one window size: computed once) are shared."""

    def __init__(self, positions: torch.Tensor):
        self.N, self.S = positions.shape
        self.positions = positions.reshape(-1)
        self.sequence = torch.arange(self.N, device=positions.device).repeat_interleave(self.S)
        self._slots: dict[int, torch.Tensor] = {}

    def per_sequence(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Rows [T, ...] -> [N, S, ...]."""
        return None if t is None else t.view(self.N, self.S, *t.shape[1:])

    def slot_positions(self, window: int) -> torch.Tensor:
        """[T, W]: window slot j of row p holds position p - W + 1 + j (< 0: no key)."""
        if window not in self._slots:
            offsets = torch.arange(window, device=self.positions.device)
            self._slots[window] = self.positions.unsqueeze(1) - window + 1 + offsets
        return self._slots[window]

    def reach_groups(self, m: int) -> list[tuple[torch.Tensor | None, int | None]]:
        """(rows, reach): groups of rows that see at most `reach` compressed entries of rate m, so that
        the entry tiles past it (all masked for these rows: exact no-ops, key_tiles.py) are skipped.
        Here one group, every row, every entry: an engine step's positions live on the device."""
        return [(None, None)]


class FullSequences(KeySource):
    """Keys of a training forward: B sequences of S tokens from position 0, rows b * S + p."""

    def __init__(self, B: int, S: int, device):
        super().__init__(torch.arange(S, device=device).expand(B, S))
        self._groups: dict[int, list] = {}

    def reach_groups(self, m: int) -> list[tuple[torch.Tensor | None, int | None]]:
        """Position p sees (p + 1) // m entries: rows grouped by position into REACH_GROUPS equal ranges,
        each walking the entry tiles its last position needs (positions are 0..S-1 in every sequence,
        known here without reading the device): ~5/8 of the tiles instead of all S / m entries. Few
        groups, not one per tile count: each group is a row-block call of its own (on CUDA one more
        eager block and graph capture), which at B = 1, S = 8192 would cost more than it saves."""
        if m not in self._groups:
            bounds = sorted({round(self.S * k / REACH_GROUPS) for k in range(REACH_GROUPS + 1)})
            dev = self.positions.device
            starts = (torch.arange(self.N, device=dev) * self.S).unsqueeze(1)
            groups = [((starts + torch.arange(a, b, device=dev)).flatten(), -(-(b // m) // ENTRY_TILE) * ENTRY_TILE)
                      for a, b in zip(bounds, bounds[1:]) if b > a]
            self._groups[m] = [(None, None)] if len(groups) == 1 else groups
        return self._groups[m]

    def window(self, attn, kv: torch.Tensor):
        """kv [T, D] -> (key rows [T, D], index [T, W], valid [T, W]): slot j = position p - W + 1 + j."""
        key_pos = self.slot_positions(attn.window)
        return kv, (self.sequence * self.S).unsqueeze(1) + key_pos, key_pos >= 0

    def compressed(self, attn, x):
        """x: the projections (InputProjections, rows) -> (entries [B, E, D], index keys [B, E, D_I] or
        None) of every closed block."""
        comp, seqs = attn.compressor, self.per_sequence
        entries = comp.forward_full(seqs(x.comp_kv), seqs(x.comp_gate), attn.inv_freq)
        index_keys = (comp.indexer.forward_full(seqs(x.index_kv), seqs(x.index_gate), attn.inv_freq)
                      if attn.layer_type == CSA else None)
        return entries, index_keys


class StepKeys(KeySource):
    """Keys of an engine step (StepBatch: N sequences, S new tokens each, rows n * S + t), read from
    and written to the per-slot caches as DeepseekV4Attention.forward_step does."""

    def __init__(self, batch, cache):
        super().__init__(batch.positions)
        self.batch, self.cache = batch, cache

    def window(self, attn, kv: torch.Tensor):
        """Rows of [ring (W) ; new tokens (S)] per sequence (window_ring.window_keys), then the new tokens
        written into the ring, as DeepseekV4Attention.forward_step does. A decode step's go through
        their compiled forms under compile_rows (compiled_rows.decode_call: ~20 small kernels per
        layer, and the write's ~10, become a few)."""
        layer_cache, batch = self.cache.layers[attn.layer_idx], self.batch
        ring, new = layer_cache.window, self.per_sequence(kv)
        args = (ring, batch.slots, new, batch.start_pos, self.sequence, self.slot_positions(attn.window))
        keys = compiled_rows.decode_call(self.S, window_keys, *args)
        compiled_rows.decode_call(self.S, write_window, ring, batch.slots, batch.positions, batch.valid,
                                  batch.num_new, new, layer_cache.scratch_slot)
        return keys

    def compressed(self, attn, x):
        """Feeds the step's tokens to the compressors (closing blocks write entries) -> (entries
        [N, E, D], index keys or None) of the slots' caches."""
        fields = {f.name: self.per_sequence(getattr(x, f.name)) for f in dataclasses.fields(x)}
        step_x = dataclasses.replace(x, **fields)
        return attn._step_compressors(step_x, self.batch, self.cache.layers[attn.layer_idx])


def _projections(attn, h: torch.Tensor, positions: torch.Tensor):
    """Rows of the layer input -> (q, kv, the compressors' projections, indexer head weights / query)."""
    x = attn._input_projections(h)
    q_res, q, kv, _, _ = attn._project(x, positions)
    index_q = index_w = None
    if attn.layer_type == CSA:
        indexer = attn.compressor.indexer
        index_q = indexer.query(q_res, positions, attn.inv_freq)
        index_w = indexer.scaled_head_weights(x.index_weights)
    return q, kv, x.comp_kv, x.comp_gate, x.index_kv, x.index_gate, index_w, index_q


def _entry_mask(attn, index_keys, positions, E: int, entry_base, index_q, index_w, reach):
    """(index, valid) [R, L] over the compressed entries 0 .. L - 1 of each row's sequence (L: whole
    tiles up to `reach` entries, None: all E): where to read entry j, and whether the row attends to
    it (closed before the row's position, below E, and in C4 layers picked by the indexer)."""
    spans = tile_spans(E if reach is None else min(E, reach))
    columns = torch.arange(spans[-1][1], device=positions.device)
    exists = columns < E
    index = entry_base.unsqueeze(1) + columns
    visible = (columns.unsqueeze(0) < attn.compressor.closed_entries(positions).unsqueeze(1)) & exists
    if attn.layer_type == CSA:
        flat_index, ok = index_keys.flatten(0, 1), exists.expand_as(index)
        scores = torch.cat([tiled_index_scores(index_q, index_w, gather_tile(flat_index, index[:, a:b], ok[:, a:b]))
                            for a, b in spans], dim=1)
        visible = attn.compressor.indexer.picked(scores, visible)
    return index, visible


def _entry_tiles(attn, entries, index_keys, positions, entry_base, index_q, index_w, reach):
    """(keys, valid) tiles over the compressed entries of each row's sequence, in entry order, up to
    `reach` entries (None: all)."""
    E = entries.shape[1]
    if E == 0 or reach == 0:  # no block has closed in any sequence yet
        return []
    index, valid = _entry_mask(attn, index_keys, positions, E, entry_base, index_q, index_w, reach)
    flat = entries.flatten(0, 1)
    return [(gather_tile(flat, i, ok), ok) for i, ok in zip(index.split(ENTRY_TILE, 1), valid.split(ENTRY_TILE, 1))]


def _whole_rows_entries(attn, index_keys, keys, E: int, index_q, index_w):
    """(index, valid) [R, E] over every row's compressed entries in one call: closed before the row's
    position and, in C4 layers, picked by the indexer from scores of one kernel
    (index_scores_triton.py; the picks' stable sort is a function of each row's scores alone)."""
    count = attn.compressor.closed_entries(keys.positions).clamp(max=E)
    base = keys.sequence * E
    columns = torch.arange(E, device=base.device)
    visible = columns < count.unsqueeze(1)
    if attn.layer_type == CSA:
        scores = index_scores_triton.index_scores(index_q, index_w, index_keys.flatten(0, 1), base, count, E)
        visible = attn.compressor.indexer.picked(scores, visible)
    return base.unsqueeze(1) + columns, visible, count


def _whole_rows_core(attn, q, window, entries, index_keys, keys, index_q, index_w):
    """The attention core of every row in one kernel (tiled_attention_triton.py), the C4 layers'
    entry picks from one more (index_scores_triton.py)."""
    entry = (None,) * 4
    E = 0 if entries is None else entries.shape[1]
    if E:
        entry = (entries.flatten(0, 1), *_whole_rows_entries(attn, index_keys, keys, E, index_q, index_w))
    return tiled_attention_triton.tiled_sink_attention(q, *window, *entry, attn.sinks, attn.scale)


def _kernels_available(q, source, index_q, index_keys) -> bool:
    """The whole-rows core's kernels can run (a C4 layer's index scores too)."""
    return tiled_attention_triton.available(q, source) and (index_q is None or index_scores_triton.available(
        index_q, index_keys))


def _output(attn, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_cos_sin(attn.inv_freq, positions)
    return attn._output(o, cos, sin)


def attention_rows(attn, h: torch.Tensor, keys, whole_rows: bool = False) -> torch.Tensor:
    """h [T, D] (the layer input's rows, in `keys`' row order) -> the attention's output [T, D].
    `whole_rows` (the caller's switch and whole_rows.kernels_run): the projections and the output
    over all rows in one call, the core in one kernel where it can (whole_rows.py)."""
    q, kv, *projections, index_w, index_q = row_local(whole_rows, _projections, h, keys.positions, owner=attn)
    source, window_index, window_valid = keys.window(attn, kv)
    entries = index_keys = None
    if attn.compressor is not None:
        with whole_rows_mode() if whole_rows else nullcontext():  # the compressors pool every entry at once
            entries, index_keys = keys.compressed(attn, attn.projections_type(None, kv, *projections))
    if whole_rows and _kernels_available(q, source, index_q, index_keys):
        o = _whole_rows_core(attn, q, (source, window_index, window_valid), entries, index_keys, keys, index_q,
                             index_w)
        return row_local(True, _output, o, keys.positions, owner=attn)

    def core(q, window_index, window_valid, positions, sequence, index_q, index_w, reach=None):
        tiles = [(gather_tile(source, window_index, window_valid), window_valid)]
        if entries is not None:
            tiles += _entry_tiles(attn, entries, index_keys, positions, sequence * entries.shape[1], index_q, index_w,
                                  reach)
        return tiled_sink_attention(q, tiles, attn.sinks, attn.scale)

    rows = (q, window_index, window_valid, keys.positions, keys.sequence, index_q, index_w)
    groups = keys.reach_groups(attn.compressor.m) if entries is not None else [(None, None)]
    if len(groups) == 1:
        o = row_blocks(core, *rows)
    else:  # a row's result does not depend on the rows beside it: any grouping gives the same bits
        o = torch.empty_like(q)
        for index, reach in groups:
            o[index] = row_blocks(partial(core, reach=reach), *(None if x is None else x[index] for x in rows))
    return row_blocks(lambda o, p: _output(attn, o, p), o, keys.positions)
