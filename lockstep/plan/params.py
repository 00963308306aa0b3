"""Parameter counts from the architecture, grouped by how they are sharded and served.

Every group records:
- `shard`: how Megatron-style model parallelism splits it on the actor
  ("tp": split over tensor-parallel ranks, by heads / columns / rows; "replicated": every TP rank
  holds it -- low-rank down projections, the single shared K=V head, compressors, mHC, norms,
  router; "expert": routed experts, split over expert-parallel ranks; "vocab": embedding and
  LM head, vocab-parallel over TP);
- `serve`: the rollout storage format of the released checkpoint (DSV4_SPEC.md table: attention
  linears, shared experts and indexer wq_b in FP8; routed experts FP4; compressor / indexer wkv,
  wgate, weights_proj, embed, head, norms BF16; hc_*, sinks, position_bias FP32);
- `matmul`: whether it costs 2 FLOPs per parameter per token in the forward pass.

DeepSeek-V4 per-layer terms (H hidden, h heads, d head_dim, r q_lora_rank, g o_groups,
l o_lora_rank, n hc_mult, E experts, I moe_intermediate, m compress ratio, c = 2 if m == 4 else 1,
hi/di indexer heads/head_dim):
  q_a H*r, q_b r*h*d, kv H*d, o_a h*d*l (g groups of h*d/g -> l), o_b g*l*H, sinks h,
  norms r + d (q_a_norm, kv_norm) + 2H (input / post-attention),
  compressor 2*H*c*d (wkv, wgate) + m*c*d (position bias) + d (norm)           [m > 0],
  indexer 2*H*2*di + 4*2*di + di + r*hi*di (wq_b) + H*hi (weights_proj)       [m == 4],
  mHC 2 * ((2+n)*n*n*H + (2+n)*n + 3), router E*H, shared 3*H*I*n_shared, experts E*3*H*I.
Model-level: embed V*H, head V*H (absent when tied), final norm H, mHC head n*n*H + n + 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lockstep.plan.model import ModelSpec

SHARDS = ("tp", "replicated", "expert", "vocab")
SERVE_FORMATS = ("fp8", "fp4", "bf16", "fp32")


@dataclass(frozen=True, kw_only=True)
class ParamGroup:
    """One named group of parameters with its count and placement."""

    name: str
    count: int
    shard: str
    serve: str
    matmul: bool = True

    def __post_init__(self):
        if self.shard not in SHARDS:
            raise ValueError(f"ParamGroup.shard must be one of {SHARDS}, got {self.shard!r}")
        if self.serve not in SERVE_FORMATS:
            raise ValueError(f"ParamGroup.serve must be one of {SERVE_FORMATS}, got {self.serve!r}")


def _g(name, count, shard, serve, matmul=True) -> ParamGroup:
    return ParamGroup(name=name, count=int(count), shard=shard, serve=serve, matmul=matmul)


def _v4_attention(m: ModelSpec, ratio: int) -> list[ParamGroup]:
    H, h, d, r = m.hidden_size, m.num_attention_heads, m.head_dim, m.q_lora_rank
    out = [
        _g("attn.q_a", H * r, "replicated", "fp8"),
        _g("attn.q_b", r * h * d, "tp", "fp8"),
        _g("attn.kv", H * d, "replicated", "fp8"),
        _g("attn.o_a", h * d * m.o_lora_rank, "tp", "fp8"),
        _g("attn.o_b", m.o_groups * m.o_lora_rank * H, "tp", "fp8"),
        _g("attn.sinks", h, "tp", "fp32", matmul=False),
        _g("attn.norms", r + d, "replicated", "bf16", matmul=False),
    ]
    if ratio:
        c = 2 if ratio == 4 else 1
        out += [
            _g(f"compressor{ratio}.wkv_wgate", 2 * H * c * d, "replicated", "bf16"),
            _g(f"compressor{ratio}.bias_norm", ratio * c * d + d, "replicated", "fp32", matmul=False),
        ]
    if ratio == 4:
        hi, di = m.index_n_heads, m.index_head_dim
        out += [
            _g("indexer.wkv_wgate", 2 * H * 2 * di, "replicated", "bf16"),
            _g("indexer.bias_norm", 4 * 2 * di + di, "replicated", "fp32", matmul=False),
            _g("indexer.wq_b", r * hi * di, "tp", "fp8"),
            _g("indexer.weights_proj", H * hi, "tp", "bf16"),
        ]
    return out


def _llama_attention(m: ModelSpec) -> list[ParamGroup]:
    H, hd = m.hidden_size, m.head_dim
    return [
        _g("attn.q", H * m.num_attention_heads * hd, "tp", "bf16"),
        _g("attn.kv", 2 * H * m.num_kv_heads * hd, "tp", "bf16"),
        _g("attn.o", m.num_attention_heads * hd * H, "tp", "bf16"),
    ]


def _mlp(m: ModelSpec, expert_serve: str, dense_serve: str) -> list[ParamGroup]:
    H = m.hidden_size
    if not m.is_moe:
        return [_g("mlp", 3 * H * m.intermediate_size, "tp", dense_serve)]
    I, E = m.moe_intermediate_size, m.n_routed_experts
    out = [
        _g("moe.router", E * H, "replicated", "bf16"),
        _g("moe.experts", E * 3 * H * I, "expert", expert_serve),
    ]
    if m.n_shared_experts:
        out.append(_g("moe.shared", m.n_shared_experts * 3 * H * I, "tp", dense_serve))
    return out


@lru_cache(maxsize=4096)
def layer_groups(m: ModelSpec, i: int) -> tuple[ParamGroup, ...]:
    """Parameter groups of decoder layer i (formulas in the module docstring); cached."""
    H, n = m.hidden_size, m.hc_mult
    if m.family == "deepseek_v4":
        out = _v4_attention(m, m.layer_kind(i)) + _mlp(m, "fp4", "fp8")
        hc = (2 + n) * n
        out.append(_g("mhc", 2 * (hc * n * H + hc + 3), "replicated", "fp32"))
    else:
        out = _llama_attention(m) + _mlp(m, "bf16", "bf16")
    out.append(_g("layer_norms", 2 * H, "replicated", "bf16", matmul=False))
    return tuple(out)


def embed_groups(m: ModelSpec) -> list[ParamGroup]:
    """Embedding (first pipeline stage)."""
    return [_g("embed", m.vocab_size * m.hidden_size, "vocab", "bf16", matmul=False)]


def head_groups(m: ModelSpec) -> list[ParamGroup]:
    """Final norm, mHC head collapse and LM head (last pipeline stage).

    A tied head shares the embedding's storage; Megatron keeps a copy on the last stage when
    PP > 1, so the planner counts the head there but not in the model total.
    """
    H, n = m.hidden_size, m.hc_mult
    out = [_g("final_norm", H, "replicated", "bf16", matmul=False)]
    if m.family == "deepseek_v4":
        out.append(_g("mhc_head", n * n * H + n + 1, "replicated", "fp32"))
    out.append(_g("head", m.vocab_size * H, "vocab", "bf16"))
    return out


def all_groups(m: ModelSpec) -> list[ParamGroup]:
    """Every group of the model, each layer's groups in order (embed first, head last)."""
    out = embed_groups(m)
    for i in range(m.num_layers):
        out += layer_groups(m, i)
    heads = head_groups(m)
    if m.tie_word_embeddings:
        heads = [g for g in heads if g.name != "head"]
    return out + heads


def total_params(m: ModelSpec) -> int:
    """Sum of every group's count (the tied head counted once)."""
    return sum(g.count for g in all_groups(m))


def active_fraction(m: ModelSpec, g: ParamGroup) -> float:
    """Share of a group each token uses: top_k / E for routed experts, 1 otherwise."""
    return m.num_experts_per_tok / m.n_routed_experts if g.shard == "expert" else 1.0


def active_params(m: ModelSpec) -> int:
    """Parameters one token touches: everything dense plus top_k of E experts per layer."""
    return round(sum(g.count * active_fraction(m, g) for g in all_groups(m)))


def matmul_params_per_token(groups, m: ModelSpec) -> float:
    """Active matmul parameters (forward FLOPs per token = 2 x this)."""
    return sum(g.count * active_fraction(m, g) for g in groups if g.matmul)


def buffer_bytes(m: ModelSpec) -> int:
    """Non-parameter buffers that define the policy and travel with a weight push:
    `tid2eid` int32 [V, top_k] per hash layer, router bias fp32 [E] per other layer."""
    if not m.is_moe or m.family != "deepseek_v4":
        return 0
    hashed = m.num_hash_layers * m.vocab_size * m.num_experts_per_tok * 4
    return hashed + (m.num_layers - m.num_hash_layers) * m.n_routed_experts * 4
