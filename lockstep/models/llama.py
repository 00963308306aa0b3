"""Dense Llama / Qwen3 family: GQA, RoPE (default / linear / llama3), SwiGLU, RMSNorm, tied embeddings.

One model, two entry points that run the same per-token arithmetic:

- `model(input_ids [B, S], attention_mask=None, position_ids=None) -> logits [B, S, V]` (float32),
  the full-sequence causal forward the trainer uses;
- `model.forward_incremental(input_ids [T], positions [T], kv_cache, batch_meta) -> logits`,
  the rollout engine's path: the T new tokens of several sequences flattened together (prefill
  chunks and decode tokens mixed), K/V written into a paged cache and read back from it.

Attention is plain PyTorch in float32 (q.k^T, softmax, p.v). Both paths round K and V to the
activation dtype before attending, so a bf16 full forward sees exactly the keys and values a
decode step reads back from a cache of that dtype (or wider). The per-token arithmetic is the
same on both paths; stock CPU/GPU matmuls still pick different reduction orders for different
row counts (M=1 decode vs M=T prefill), so agreement is ~1e-7 relative in fp32, not bitwise. Parameter names are transformers'
(`model.layers.0.self_attn.q_proj.weight` ...), so `hf_model.state_dict()` loads as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.models.llama_config import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in float32, then scaled back in the input dtype (as transformers does)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) for the config's RoPE type."""
    dim, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # low_freq_wavelen and high_freq_wavelen interpolated smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., head_dim] (float32); a function of the position only."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] rotated (half-split convention) in float32; cos/sin [..., D]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[..., None, :] + rotated * sin[..., None, :]).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax attention in float32 with grouped KV heads.

    q [..., Hq, Q, D], k / v [..., Hkv, K, D], visible bool [..., Q, K] -> [..., Hq, Q, D] float32.
    Query head h reads KV head h // (Hq / Hkv). A row that sees nothing (padding) outputs zeros.
    """
    *lead, hq, nq, d = q.shape
    hkv, nk = k.shape[-3], k.shape[-2]
    group = hq // hkv
    qg = q.float().reshape(*lead, hkv, group * nq, d)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * d**-0.5
    scores = scores.view(*lead, hkv, group, nq, nk)
    scores = scores.masked_fill(~visible[..., None, None, :, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = torch.matmul(probs.view(*lead, hkv, group * nq, nk), v.float())
    return out.view(*lead, hq, nq, d)


# ---- paged KV cache interface (the rollout engine drives it) ---------------------------------------

@dataclass
class PagedKVCache:
    """K and V of every layer in fixed-size blocks: [num_layers, num_blocks, block_size, Hkv, head_dim].

    Token j of a sequence lives in slot `block_table[j // block_size] * block_size + j % block_size`.
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @classmethod
    def allocate(cls, config: LlamaConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device="cpu") -> "PagedKVCache":
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k / v [T, Hkv, D] of the new tokens into their slots."""
        self.k[layer].view(-1, *k.shape[1:])[slot_mapping] = k.to(self.k.dtype)
        self.v[layer].view(-1, *v.shape[1:])[slot_mapping] = v.to(self.v.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, Hkv, D] keys and values at `slots` (one sequence's positions 0..L-1, in order)."""
        return self.k[layer].flatten(0, 1)[slots], self.v[layer].flatten(0, 1)[slots]


@dataclass(frozen=True)
class BatchMeta:
    """Everything one incremental step needs besides the tokens and their positions.

    B sequences contribute T = query_start_loc[-1] new tokens, flattened in sequence order.
    """

    query_start_loc: torch.Tensor  # [B + 1] int64: sequence b's new tokens are rows qsl[b]:qsl[b+1]
    context_lens: torch.Tensor  # [B] int64: tokens of sequence b in the cache after this step's writes
    block_tables: torch.Tensor  # [B, max_blocks] int64: physical block of each logical block (-1: unused)
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    logits_indices: torch.Tensor | None = None  # [N] rows of the T tokens to return logits for; None: all

    def context_slots(self, block_size: int) -> list[torch.Tensor]:
        """Per sequence, the cache slots of its positions 0..context_len-1."""
        out = []
        for b, n in enumerate(self.context_lens.tolist()):
            pos = torch.arange(n, device=self.block_tables.device)
            out.append(self.block_tables[b, pos // block_size] * block_size + pos % block_size)
        return out


def prepare_step(block_tables: torch.Tensor, num_cached: list[int], num_new: list[int], block_size: int,
                 logits_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, BatchMeta]:
    """(positions [T], BatchMeta) for sequences that hold `num_cached` tokens and append `num_new`."""
    dev = block_tables.device
    positions = torch.cat([torch.arange(c, c + n, device=dev) for c, n in zip(num_cached, num_new)]).long()
    seq = torch.repeat_interleave(torch.arange(len(num_new), device=dev), torch.tensor(num_new, device=dev))
    slots = block_tables[seq, positions // block_size] * block_size + positions % block_size
    qsl = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.long, device=dev)
    context = torch.tensor([c + n for c, n in zip(num_cached, num_new)], dtype=torch.long, device=dev)
    return positions, BatchMeta(qsl, context, block_tables.long(), slots.long(), logits_indices)


# ---- the model ------------------------------------------------------------------------------------

class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx, self.n_heads, self.n_kv, self.head_dim = layer_idx, c.num_attention_heads, \
            c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., D] -> q [..., Hq, Dh], k / v [..., Hkv, Dh], RoPE applied, in x's dtype."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, visible):
        """Full sequence: x [B, S, D], visible [B, S, S]."""
        q, k, v = self.qkv(x, cos, sin)
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible)  # [B, Hq, S, Dh]
        return self.o_proj(o.transpose(1, 2).flatten(2).to(x.dtype))

    def forward_paged(self, x, cos, sin, positions, cache: PagedKVCache, meta: BatchMeta, slots):
        """New tokens: x [T, D]; writes their K/V, then attends each sequence over its cache."""
        q, k, v = self.qkv(x, cos, sin)
        cache.write(self.layer_idx, meta.slot_mapping, k, v)
        qsl = meta.query_start_loc.tolist()
        outs = []
        for b, seq_slots in enumerate(slots):
            rows = slice(qsl[b], qsl[b + 1])
            kb, vb = cache.read(self.layer_idx, seq_slots)
            key_pos = torch.arange(len(seq_slots), device=x.device)
            visible = key_pos[None, :] <= positions[rows, None]
            outs.append(attend(q[rows].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1), visible))
        o = torch.cat(outs, dim=1).transpose(0, 1)  # [T, Hq, Dh]
        return self.o_proj(o.flatten(1).to(x.dtype))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, attn_fn):
        x = x + attn_fn(self.self_attn, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    _keep_in_fp32_modules_strict: tuple[str, ...] = ()  # transformers keeps nothing of Llama in fp32 under bf16

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def _rope(self, positions: torch.Tensor):
        # recomputed per call (head_dim / 2 numbers), so a model.to(bf16) can never degrade it
        return rope_cos_sin(rope_inv_freq(self.config).to(positions.device), positions)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x)).float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, V] float32. attention_mask [B, S]: 1 = token, 0 = padding
        (never attended to). position_ids default to 0..S-1; pass them for left-padded batches."""
        bsz, seq = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(seq, device=dev).expand(bsz, seq)
        idx = torch.arange(seq, device=dev)
        visible = (idx[None, :] <= idx[:, None]).expand(bsz, seq, seq)
        if attention_mask is not None:
            visible = visible & attention_mask.bool()[:, None, :]
        cos, sin = self._rope(position_ids)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, lambda attn, h: attn(h, cos, sin, visible))
        return self._logits(x)

    def forward_incremental(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                            batch_meta: BatchMeta) -> torch.Tensor:
        """input_ids / positions [T] (new tokens of all sequences, flattened) -> logits [T or N, V] float32."""
        if input_ids.shape != positions.shape or input_ids.numel() != batch_meta.slot_mapping.numel():
            raise ValueError(f"forward_incremental: input_ids {tuple(input_ids.shape)}, positions "
                             f"{tuple(positions.shape)} and slot_mapping {tuple(batch_meta.slot_mapping.shape)} "
                             "must all be [T]")
        slots = batch_meta.context_slots(kv_cache.block_size)
        cos, sin = self._rope(positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, lambda attn, h: attn.forward_paged(h, cos, sin, positions, kv_cache, batch_meta, slots))
        if batch_meta.logits_indices is not None:
            x = x[batch_meta.logits_indices]
        return self._logits(x)
