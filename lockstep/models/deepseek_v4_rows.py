"""The true-on-policy forward of DeepSeek-V4: a token's logits have the same bits whether the
engine computed them in a decode step (any batch, any CUDA-graph bucket), in a prefill chunk, or
the trainer in a whole-sequence training forward (KernelSwitches.true_on_policy; issue 16).

Two rules make it so, on any device and in any dtype:
1. Everything a token computes on its own (mHC, norms, projections, RoPE, the MoE, the head) runs
   in row blocks of a fixed size (layers/row_blocks.py): every GEMM and reduction is called with
   the same shapes on every side, so a token's result cannot depend on how many others share its
   call. The routed experts run dense (Experts.dense_rows): grouping rows by expert would make a
   row's GEMM size depend on its neighbours' choices.
2. What a token reads from other tokens comes in a fixed layout (layers/key_tiles.py): its
   window in position order, then the compressed entries in fixed tiles, walked by one online
   softmax; compressed entries themselves are pooled in row blocks (Compressor.entries_from_blocks),
   so a block pooled by a training forward and one closed by a decode step are the same entry.

Layer by layer, tokens are flat rows [T] (B x S for training, N x S new tokens for a step):
    part A (rows): mHC collapse, norm, input projections, q / kv / indexer query
    attention (rows, keys gathered per row): window tile + entry tiles -> o
    part C (rows): output projection, mHC combine, MoE sub-block with its mHC
The two callers differ only in where keys come from: `FullSequences` (training: each row's
sequence, from position 0) and `StepKeys` (the engine: window ring + new tokens, the caches'
entries, and the cache writes a step makes).

Cost: the dense experts (E / k times the routed FLOPs) and the per-block loop; the GPU kernels of
the issue's item 2 are to replace the row blocks where they are measured faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .deepseek_v4_config import CSA
from .layers.attention import DeepseekV4Attention, InputProjections
from .layers.hyper_connection import hc_combine
from .layers.key_tiles import gather_tile, tile_spans, tiled_index_scores, tiled_sink_attention
from .layers.rope import rope_cos_sin
from .layers.row_blocks import row_blocks


class FullSequences:
    """Keys of a training forward: B sequences of S tokens from position 0, rows b * S + p."""

    def __init__(self, B: int, S: int, device):
        self.B, self.S = B, S
        self.positions = torch.arange(S, device=device).repeat(B)
        self.sequence = torch.arange(B, device=device).repeat_interleave(S)

    def window(self, attn: DeepseekV4Attention, kv: torch.Tensor, layer: int):
        """kv [T, D] -> (key rows [T, D], index [T, W], valid [T, W]): slot j = position p - W + 1 + j."""
        key_pos = self.positions.unsqueeze(1) - attn.window + 1 + torch.arange(attn.window, device=kv.device)
        return kv, (self.sequence * self.S).unsqueeze(1) + key_pos, key_pos >= 0

    def compressed(self, attn: DeepseekV4Attention, x: InputProjections, layer: int):
        """-> (entries [B, E, D], index keys [B, E, D_I] or None) of every closed block."""
        def seqs(t):
            return None if t is None else t.view(self.B, self.S, -1)
        comp = attn.compressor
        entries = comp.forward_full(seqs(x.comp_kv), seqs(x.comp_gate), attn.inv_freq)
        index_keys = (comp.indexer.forward_full(seqs(x.index_kv), seqs(x.index_gate), attn.inv_freq)
                      if attn.layer_type == CSA else None)
        return entries, index_keys


class StepKeys:
    """Keys of an engine step (StepBatch: N sequences, S new tokens each, rows n * S + t), read from
    and written to the per-slot caches as DeepseekV4Attention.forward_step does."""

    def __init__(self, batch, cache):
        self.batch, self.cache = batch, cache
        N, S = batch.positions.shape
        self.N, self.S = N, S
        self.positions = batch.positions.reshape(-1)
        self.sequence = torch.arange(N, device=batch.positions.device).repeat_interleave(S)

    def window(self, attn: DeepseekV4Attention, kv: torch.Tensor, layer: int):
        """Rows of [ring (W) ; new tokens (S)] per sequence; positions before the step's first new token
        come from the ring (position q at ring index q mod W), the others from the new tokens."""
        W, layer_cache = attn.window, self.cache.layers[layer]
        new = kv.view(self.N, self.S, -1)
        source = torch.cat([layer_cache.window[self.batch.slots].to(kv.dtype), new], dim=1).flatten(0, 1)
        attn._write_window(layer_cache, self.batch, new)
        key_pos = self.positions.unsqueeze(1) - W + 1 + torch.arange(W, device=kv.device)
        start = self.batch.start_pos[self.sequence].unsqueeze(1)
        within = torch.where(key_pos < start, torch.remainder(key_pos, W), W + key_pos - start)
        return source, (self.sequence * (W + self.S)).unsqueeze(1) + within, key_pos >= 0

    def compressed(self, attn: DeepseekV4Attention, x: InputProjections, layer: int):
        def seqs(t):
            return None if t is None else t.view(self.N, self.S, -1)
        step_x = InputProjections(*(seqs(getattr(x, f)) for f in InputProjections.__dataclass_fields__))
        return attn._step_compressors(step_x, self.batch, self.cache.layers[layer])


def _part_a(layer, streams: torch.Tensor, positions: torch.Tensor):
    """Rows up to attention: (post, comb, q, kv, the compressors' projections, indexer query / weights)."""
    attn = layer.self_attn
    collapsed, post, comb = layer.attn_hc(streams)
    x = attn._input_projections(layer.input_layernorm(collapsed))
    q_res, q, kv, _, _ = attn._project(x, positions)
    index_q = index_w = None
    if attn.layer_type == CSA:
        indexer = attn.compressor.indexer
        index_q = indexer.query(q_res, positions, attn.inv_freq)
        index_w = indexer.scaled_head_weights(x.index_weights)
    return post, comb, q, kv, x.comp_kv, x.comp_gate, x.index_kv, x.index_gate, index_w, index_q


def _entry_tiles(attn, entries, index_keys, positions, entry_base, index_q, index_w):
    """(keys, valid) tiles over the compressed entries of each row's sequence, in entry order."""
    E, dev = entries.shape[1], positions.device
    spans = tile_spans(E)
    if not spans:  # no block has closed in any sequence yet
        return []
    flat, flat_index = entries.flatten(0, 1), None if index_keys is None else index_keys.flatten(0, 1)
    columns = [torch.arange(a, b, device=dev) for a, b in spans]
    exists = [c < E for c in columns]
    index = [entry_base.unsqueeze(1) + c for c in columns]
    visible = torch.cat(columns).unsqueeze(0) < ((positions + 1) // attn.compressor.m).unsqueeze(1)
    if attn.layer_type == CSA:
        scores = torch.cat([tiled_index_scores(index_q, index_w, gather_tile(flat_index, i, ok.expand_as(i)))
                            for i, ok in zip(index, exists)], dim=1)
        visible = attn.compressor.indexer.picked(scores, visible & torch.cat(exists))
    chosen = visible.split([b - a for a, b in spans], dim=1)
    return [(gather_tile(flat, i, ok & c), ok & c) for i, ok, c in zip(index, exists, chosen)]


def _attention(layer, keys, x: InputProjections, q, kv, index_q, index_w, layer_idx: int):
    attn = layer.self_attn
    source, window_index, window_valid = keys.window(attn, kv, layer_idx)
    entries = index_keys = None
    if attn.compressor is not None:
        entries, index_keys = keys.compressed(attn, x, layer_idx)

    def core(q, window_index, window_valid, positions, sequence, index_q, index_w):
        tiles = [(gather_tile(source, window_index, window_valid), window_valid)]
        if entries is not None:
            tiles += _entry_tiles(attn, entries, index_keys, positions, sequence * entries.shape[1], index_q, index_w)
        return tiled_sink_attention(q, tiles, attn.sinks, attn.scale)

    return row_blocks(core, q, window_index, window_valid, keys.positions, keys.sequence, index_q, index_w)


def _part_c(layer, streams, o, positions, post, comb, token_ids, forced):
    """Rows from attention's output to the layer's output streams, and the routed experts."""
    attn = layer.self_attn
    cos, sin = rope_cos_sin(attn.inv_freq, positions)
    streams = hc_combine(streams, attn._output(o, cos, sin), post, comb)
    collapsed, post, comb = layer.ffn_hc(streams)
    out, experts = layer.mlp(layer.post_attention_layernorm(collapsed), token_ids, forced)
    return hc_combine(streams, out, post, comb), experts


def layer_rows(layer, streams: torch.Tensor, token_ids: torch.Tensor, keys, routing) -> torch.Tensor:
    """One decoder layer over flat rows: streams [T, n, D], token_ids [T] -> streams [T, n, D]."""
    post, comb, q, kv, *projections, index_w, index_q = row_blocks(
        lambda s, p: _part_a(layer, s, p), streams, keys.positions)
    x = InputProjections(None, kv, *projections)
    o = _attention(layer, keys, x, q, kv, index_q, index_w, layer.layer_idx)
    forced = routing.forced_for(layer.layer_idx) if routing is not None else None
    forced = None if forced is None else forced.reshape(-1, forced.shape[-1])
    streams, experts = row_blocks(lambda *a: _part_c(layer, *a), streams, o, keys.positions, post, comb,
                                  token_ids, forced)
    if routing is not None:
        routing.chosen.append(experts.view(-1, keys.S, experts.shape[-1]))
    return streams


def hidden_rows(model, input_ids: torch.Tensor, keys, routing) -> torch.Tensor:
    """DeepseekV4Model's run through the true-on-policy forward: input_ids [N, S] (the rows of
    `keys`) -> final hidden states [N, S, H]."""
    ids = input_ids.reshape(-1)
    streams = model.embed_streams(ids)
    for layer in model.layers:
        streams = layer_rows(layer, streams, ids, keys, routing)
    return row_blocks(model.final_hidden, streams).view(*input_ids.shape, streams.shape[-1])


def logits_rows(lm_head_weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] -> logits [..., V] fp32, the head in row blocks (an fp32 GEMM on every side)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    logits = row_blocks(lambda h: F.linear(h.float(), lm_head_weight.float()), flat)
    return logits.view(*hidden.shape[:-1], lm_head_weight.shape[0])
