"""DeepSeek-V4 hybrid attention: sliding window + (C4 top-k | C128 dense) compressed entries.

    c_q = Norm(W_qa h);  q = RoPE(RMSNorm_per_head(W_qb c_q))         [S, H, D]
    kv  = RoPE(Norm(W_kv h))                                           [S, D]  (K = V)
    attended set of query p = window {p-W+1..p} ∪ visible compressed entries (no de-dup)
    o   = RoPE^-1(sink_attention(q, keys, bias))   (K = V carried rope: undo it at p)
    out = W_ob · grouped(W_oa, o)                   (o_groups independent low-rank blocks)
Window-only layers rotate with the plain `main` frequencies, compressed layers with the
(YaRN) `compress` ones. `forward_full` serves training (whole sequences from position 0),
`forward_step` the rollout engine (new tokens appended to per-slot caches), `forward_rows` both in
the true-on-policy forward (attention_rows.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..deepseek_v4_config import CSA, HCA, SLIDING
from . import output_a_triton, qk_norm_rope_triton, step_attention_triton
from .attention_rows import attention_rows
from .compressor import Compressor, CompressorState
from .fixed_shapes import fixed_shape
from .fp8_linear import Fp8Linear
from .flash_sink_attention_triton import flash_banded_sink_attention, runs as flash_attention_runs
from .fused_linear import project
from .indexer import Indexer
from .kernel_switch import Switched
from .norm import RMSNorm, rms_norm
from .rope import apply_rope, inv_freq_for, rope_cos_sin
from .sink_attention import banded_sink_attention, closed_block_bias, pad_keys, sink_attention, window_bias
from .whole_rows import apply_linear, in_whole_rows, linear
from .window_ring import read_window, write_window


class CSACompressor(Compressor):
    """C4 compressor: overlapping blocks, plus the lightning indexer that picks entries."""

    def __init__(self, c):
        super().__init__(c.hidden_size, c.head_dim, c.compress_rates[CSA], overlap=True, norm_eps=c.rms_norm_eps)
        self.indexer = Indexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim, c.index_topk,
                               c.compress_rates[CSA], c.rms_norm_eps)


def make_compressor(c, layer_type: str) -> Compressor | None:
    if layer_type == CSA:
        return CSACompressor(c)
    if layer_type == HCA:
        return Compressor(c.hidden_size, c.head_dim, c.compress_rates[HCA], overlap=False, norm_eps=c.rms_norm_eps)
    return None


class GroupedLinear(nn.Module):
    """Block-diagonal projection: each of n_groups input slices gets its own [out/n_groups, in] weight."""

    def __init__(self, in_per_group: int, out_features: int, n_groups: int):
        super().__init__()
        self.n_groups = n_groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., G, in] -> [..., G, out/G]."""
        w = self.weight.view(self.n_groups, -1, self.weight.shape[-1])
        if in_whole_rows():  # the grouped fixed-order GEMM (whole_rows.py); einsum's batched GEMM picks by rows
            return linear(x, w)
        return torch.einsum("...gi,goi->...go", x, w)


@dataclass
class LayerCache:
    """One layer's rollout state: the sliding window ring and the compressors' state."""

    window: torch.Tensor  # [slots, W, D], position p lives at p % W
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    @property
    def scratch_slot(self) -> int:
        """The extra last slot that absorbs masked-out writes (never handed to a sequence)."""
        return self.window.shape[0] - 1

    def initial_values(self) -> list[tuple[torch.Tensor, float]]:
        """Each cache tensor of the layer and the value an empty slot holds."""
        values = [(self.window, 0.0)]
        for s in (self.compressor, self.indexer):
            if s is not None:
                values += s.initial_values()
        return values

    def reset(self, slots: torch.Tensor) -> None:
        for t, value in self.initial_values():
            t[slots] = value

    def tensors(self) -> list[torch.Tensor]:
        out = [self.window]
        for s in (self.compressor, self.indexer):
            if s is not None:
                out += s.tensors()
        return out


@dataclass
class InputProjections:
    """The layer input's projections (window / HCA layers leave the compressors' or indexer's None)."""

    q_a: torch.Tensor
    kv: torch.Tensor
    comp_kv: torch.Tensor | None = None
    comp_gate: torch.Tensor | None = None
    index_kv: torch.Tensor | None = None
    index_gate: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None


class DeepseekV4Attention(Switched, nn.Module):
    projections_type = InputProjections  # for attention_rows.py, which cannot import this module

    def __init__(self, c, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # which of a step's layer caches is this layer's
        self.layer_type = c.layer_types[layer_idx]
        self.n_heads, self.head_dim, self.window = c.num_attention_heads, c.head_dim, c.sliding_window
        self.o_groups = c.o_groups
        self.scale = c.head_dim**-0.5
        self.norm_eps = c.rms_norm_eps
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.o_a_proj = GroupedLinear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, c.o_groups)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(c.num_attention_heads))
        self.compressor = make_compressor(c, self.layer_type)
        compressed = self.layer_type != SLIDING
        theta = c.compress_rope_theta if compressed else c.rope_theta
        scaling = c.compress_rope_scaling if compressed else None
        # deliberately not a buffer: model.to(bfloat16) would round the frequencies (and did: a
        # bf16 engine and a trainer with fp32 frequencies disagreed by ~0.06 logprob per token)
        self._inv_freq = fixed_shape(inv_freq_for(c.rope_head_dim, theta, scaling))

    @property
    def inv_freq(self) -> torch.Tensor:
        """Rotary frequencies, fp32, on the module's device."""
        device = self.q_a_proj.weight.device
        if self._inv_freq.device != device:  # parameters moved without .to (load_state_dict(assign=True))
            self._inv_freq = fixed_shape(self._inv_freq.to(device))
        return self._inv_freq

    def _apply(self, fn, recurse=True):
        # model.to / .cuda move the frequencies with the parameters, but never cast them (see
        # __init__). Moved here, not lazily on first use: a first use inside a compiled layer
        # traced the move, so every layer kind compiled once more when its frequencies were
        # already on the GPU (a graph guarded on their device: 9 graphs instead of 6, tiny model)
        super()._apply(fn, recurse)
        device = fn(torch.empty(0, device=self._inv_freq.device)).device
        self._inv_freq = fixed_shape(self._inv_freq.to(device))
        return self

    # ---- shared pieces ----------------------------------------------------------------

    def input_linears(self) -> list[nn.Linear]:
        """Every projection of the layer input h, in `_input_projections`' order (fused_linear.py)."""
        linears = [self.q_a_proj, self.kv_proj]
        if self.compressor is not None:
            linears += [self.compressor.kv_proj, self.compressor.gate_proj]
        if self.layer_type == CSA:
            ix = self.compressor.indexer
            linears += [ix.kv_proj, ix.gate_proj, ix.scorer.weights_proj]
        return linears

    def _input_projections(self, h: torch.Tensor) -> InputProjections:
        return InputProjections(*project(self, self.input_linears(), h))

    def _project(self, x: InputProjections, positions: torch.Tensor):
        """Projections at positions [...] (any leading shape) -> q_res, q [..., H, D], kv [..., D], cos, sin."""
        q_res, q = self._queries(x, positions)
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        q, kv = self._normed_rotated(q, x.kv, cos, sin)
        return q_res, q, kv, cos, sin

    def _queries(self, x: InputProjections, positions: torch.Tensor):
        """-> q_res and the queries before their norm [..., H, D]."""
        q_res = self.q_a_norm(x.q_a)
        return q_res, apply_linear(self.q_b_proj, q_res).view(*positions.shape, self.n_heads, self.head_dim)

    def _normed_rotated(self, q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The queries' per-head norm and the key's norm, then their rotary embeddings -> q, kv."""
        q = rms_norm(q, self.norm_eps, triton=self.kernels.on("triton_norm"))
        rope = self.kernels.on("triton_rope")
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2), rope)
        kv = apply_rope(self.kv_norm(kv), cos, sin, rope)
        return q, kv

    def _output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output o [..., H, D] -> the layer's output [..., hidden]."""
        o = apply_rope(o, cos.unsqueeze(-2), -sin.unsqueeze(-2), self.kernels.on("triton_rope"))  # undo V's rope
        grouped = self.o_a_proj(o.reshape(*o.shape[:-2], self.o_groups, -1))
        return apply_linear(self.o_b_proj, grouped.flatten(-2))

    def _output_step(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`_output` of a step's o [N, S, H, D]: at a decode step the rotation back and wo_a in one
        kernel (output_a_triton.py) where wo_a is a GroupedLinear or its packed fp8 form."""
        if not output_a_triton.runs(o, self.kernels.on("triton_attention")):
            return self._output(o, cos, sin)
        wo_a = self.o_a_proj
        if isinstance(wo_a, GroupedLinear):
            packed = ()
        elif isinstance(wo_a, Fp8Linear) and wo_a.n_groups == self.o_groups:
            packed = (wo_a.weight_scale, wo_a.scale_row)
        else:
            return self._output(o, cos, sin)
        N, S, H, D = o.shape
        weight = wo_a.weight.view(torch.uint8) if packed else wo_a.weight
        half = cos.shape[-1]
        grouped = output_a_triton.derope_output_a(o.reshape(N * S, H, D), cos.reshape(-1, half), sin.reshape(-1, half),
                                                  weight, self.o_groups, *packed)
        return apply_linear(self.o_b_proj, grouped.view(N, S, -1))

    def _compressed_bias(self, x: InputProjections, q_res, positions, num_entries: int, index_keys) -> torch.Tensor:
        if self.layer_type == CSA:
            return self.compressor.indexer.select(x.index_weights, q_res, positions, index_keys, self.inv_freq)
        return closed_block_bias(positions, num_entries, self.compressor.m)

    # ---- training: whole sequences from position 0 -----------------------------------

    def forward_full(self, h: torch.Tensor) -> torch.Tensor:
        N, S, _ = h.shape
        positions = torch.arange(S, device=h.device).expand(N, S)
        x = self._input_projections(h)
        q_res, q, kv, cos, sin = self._project(x, positions)
        entries = comp_bias = None
        if self.compressor is not None:
            entries = self.compressor.forward_full(x.comp_kv, x.comp_gate, self.inv_freq)
            index_keys = (self.compressor.indexer.forward_full(x.index_kv, x.index_gate, self.inv_freq)
                          if self.layer_type == CSA else None)
            comp_bias = self._compressed_bias(x, q_res, positions, entries.shape[1], index_keys)
        if flash_attention_runs(q, kv, self.kernels.on("flash_attention")):  # the trainer's, when switched on
            rate = self.compressor.m if self.compressor is not None else None
            o = flash_banded_sink_attention(q, kv, self.window, self.sinks, self.scale, entries, comp_bias, rate)
        else:
            o = banded_sink_attention(q, kv, self.window, self.sinks, self.scale, entries, comp_bias)
        return self._output(o, cos, sin)

    # ---- the true-on-policy forward: rows, keys from `keys` --------------------------

    def forward_rows(self, h: torch.Tensor, keys, whole_rows: bool = False) -> torch.Tensor:
        """h [T, hidden] rows -> [T, hidden]; keys: FullSequences or StepKeys (attention_rows.py)."""
        return attention_rows(self, h, keys, whole_rows)

    # ---- rollout: new tokens appended to per-slot caches -------------------------------

    def forward_step(self, h: torch.Tensor, batch, cache: LayerCache) -> torch.Tensor:
        """h [N, S, H]; batch: StepBatch (slots, start_pos, num_new, positions, valid)."""
        x = self._input_projections(h)
        q_res, q = self._queries(x, batch.positions)
        if step_attention_triton.runs(q, self.kernels.on("triton_attention")):
            q, cos, sin = self._prepare_in_cache(q, x.kv, batch, cache)
            o = self._attend_in_cache(x, q_res, q, batch, cache)
        else:
            cos, sin = rope_cos_sin(self.inv_freq, batch.positions)
            q, kv = self._normed_rotated(q, x.kv, cos, sin)
            o = self._attend_gathered(x, q_res, q, kv, batch, cache)
        return self._output_step(o, cos, sin)

    def _prepare_in_cache(self, q, kv, batch, cache: LayerCache):
        """The positions' cos / sin, `_normed_rotated`, the key written into the window ring -> the
        queries, cos, sin; one kernel where it runs (qk_norm_rope_triton.py)."""
        if qk_norm_rope_triton.runs(q, cache.window):
            return qk_norm_rope_triton.qk_norm_rope_step(q, kv, self.kv_norm.weight, self.inv_freq, self.norm_eps,
                                                         cache.window, batch.slots, batch.positions, batch.valid,
                                                         batch.num_new, cache.scratch_slot)
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions)
        q, kv = self._normed_rotated(q, kv, cos, sin)
        write_window(cache.window, batch.slots, batch.positions, batch.valid, batch.num_new, kv,
                     cache.scratch_slot)
        return q, cos, sin

    def _attend_in_cache(self, x: InputProjections, q_res, q, batch, cache: LayerCache) -> torch.Tensor:
        """A decode step's attention by the kernel that reads the ring and the entries where they
        are cached (step_attention_triton.py): the window ring holds the step's keys already."""
        entries = picks = None
        rate = 0
        if self.compressor is not None:
            index_keys = self._update_compressors(x, batch, cache)
            entries, rate = cache.compressor.entries, self.compressor.m
            if self.layer_type == CSA:
                picks = self.compressor.indexer.select_indices(x.index_weights, q_res, batch.positions, index_keys,
                                                               self.inv_freq)
        return step_attention_triton.sink_attention_step(q, cache.window, batch.slots, batch.positions, self.sinks,
                                                         self.scale, entries, picks, rate)

    def _attend_gathered(self, x: InputProjections, q_res, q, kv, batch, cache: LayerCache) -> torch.Tensor:
        """A step's attention by torch ops over the keys gathered from the caches, with a 0 / -inf bias."""
        ring_keys, ring_pos = read_window(cache.window, batch.slots, batch.start_pos)
        keys = torch.cat([ring_keys, kv], dim=1)
        k_pos = torch.cat([ring_pos, batch.positions], dim=1)
        k_valid = torch.cat([ring_pos >= 0, batch.valid], dim=1)
        bias = window_bias(batch.positions, k_pos, k_valid, self.window)
        write_window(cache.window, batch.slots, batch.positions, batch.valid, batch.num_new, kv,
                     cache.scratch_slot)
        if self.compressor is not None:
            entries, index_keys = self._step_compressors(x, batch, cache)
            comp_bias = self._compressed_bias(x, q_res, batch.positions, entries.shape[1], index_keys)
            keys, bias = torch.cat([keys, entries], dim=1), torch.cat([bias, comp_bias], dim=2)
        keys, bias = pad_keys(keys, bias)
        return sink_attention(q, keys, bias, self.sinks, self.scale)

    def _step_compressors(self, x: InputProjections, batch, cache: LayerCache):
        """The step's tokens into the compressors -> (the slots' entries [N, E, D], the CSA indexer's
        keys or None)."""
        index_keys = self._update_compressors(x, batch, cache)
        return cache.compressor.entries[batch.slots, :self._used_entries(batch)], index_keys

    def _used_entries(self, batch) -> int | None:
        """Entries of positions < max_end (a host int), or None: the whole capacity (masked by position)."""
        return None if batch.max_end is None else batch.max_end // self.compressor.m

    def _update_compressors(self, x: InputProjections, batch, cache: LayerCache) -> torch.Tensor | None:
        """The step's tokens into the compressors' state -> the CSA indexer's keys [N, E, D_I] (None
        in an HCA layer)."""
        args = (batch.start_pos, batch.num_new)
        self.compressor.forward_step(x.comp_kv, x.comp_gate, *args, cache.compressor, batch.slots, self.inv_freq)
        if self.layer_type != CSA:
            return None
        self.compressor.indexer.forward_step(x.index_kv, x.index_gate, *args, cache.indexer, batch.slots,
                                             self.inv_freq)
        return cache.indexer.entries[batch.slots, :self._used_entries(batch)]

    def new_cache(self, num_slots: int, max_len: int, dtype, device) -> LayerCache:
        num_slots += 1  # + the scratch slot
        cache = LayerCache(torch.zeros(num_slots, self.window, self.head_dim, dtype=dtype, device=device))
        if self.compressor is not None:
            n = max_len // self.compressor.m + 1
            cache.compressor = CompressorState(num_slots, n, self.compressor, dtype, device)
            if self.layer_type == CSA:
                cache.indexer = CompressorState(num_slots, n, self.compressor.indexer, dtype, device)
        for t in cache.tensors():  # allocated once per engine: constants to the compiled layers
            fixed_shape(t)
        return cache
