"""Activations one token leaves behind in one decoder layer for the backward pass.

Counted tensor by tensor, in bytes per token, bf16 (2 B) unless fp32 (4 B) is named. Assumes
fused kernels: flash-style attention keeps its output and log-sum-exp (not the score matrix),
the indexer keeps its top-k indices (not the scores), and no dropout masks. `split` says whether
tensor parallelism with sequence parallelism divides the tensor across the TP ranks (sequence-
split residual streams and MoE tokens, head-split attention tensors) or every TP rank keeps it
whole (the low-rank q_a path, the single K=V head, compressor and indexer keys).

DeepSeek-V4 (H hidden, n hc_mult, h*d heads*head_dim, r q_lora_rank, g*l o_groups*o_lora_rank,
k top_k, I moe_intermediate, E experts):
  per sub-block (attention, MoE) mHC: streams n*H*2, fp32 normed streams n*H*4, mixes (2+n)*n*4,
      collapsed H*2, block norm H*2
  attention: q_a out + norm 2*r*2, q_b out + normed/roped q 2*h*d*2, kv out + normed/roped 2*d*2,
      core output h*d*2 + lse h*4, inverse-rope output h*d*2, o_a output g*l*2
  C4/C128 compressor: kv and gate in fp32 2*c*d*4; C4 indexer: q hi*di*2, kv and gate fp32
      2*2*di*4, top-k indices topk*4
  MoE: router logits + scores 2*E*4, dispatched tokens k*H*2, fc1 k*2I*2, SwiGLU out k*I*2,
      expert output k*H*2 (kept for the routing weights' gradient), shared fc1 2*Is*2 + out Is*2
Llama: input + norm 2*H*2 per sub-block, q/k/v (h + 2*kv)*d*2, attention out h*d*2 + lse h*4,
  MLP fc1 2*I*2 + SwiGLU out I*2.

With full recomputation (Megatron `--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1`) a layer keeps only its input: n*H*2 bytes per token (the n mHC
streams), split by sequence parallelism; one layer's full set is rebuilt during backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lockstep.plan.model import ModelSpec

A, F = 2, 4  # bf16 and fp32 bytes


@dataclass(frozen=True)
class ActTerm:
    name: str
    bytes_per_token: float
    split: bool  # divided by TP (sequence / head parallel) or kept whole on every TP rank


def _mhc(m: ModelSpec, tag: str) -> list[ActTerm]:
    n, H = m.hc_mult, m.hidden_size
    out = [ActTerm(f"{tag}.residual_in", n * H * A, True)]
    if n > 1:
        out += [ActTerm(f"{tag}.mhc_normed_fp32", n * H * F, True),
                ActTerm(f"{tag}.mhc_mixes_fp32", (2 + n) * n * F, True),
                ActTerm(f"{tag}.collapsed", H * A, True)]
    return out + [ActTerm(f"{tag}.norm_out", H * A, True)]


def _v4_attention(m: ModelSpec, ratio: int) -> list[ActTerm]:
    hd, d, r = m.num_attention_heads * m.head_dim, m.head_dim, m.q_lora_rank
    out = [
        ActTerm("attn.q_a", 2 * r * A, False),
        ActTerm("attn.q_b", 2 * hd * A, True),
        ActTerm("attn.kv", 2 * d * A, False),
        ActTerm("attn.core_out_lse", hd * A + m.num_attention_heads * F, True),
        ActTerm("attn.unrope_out", hd * A, True),
        ActTerm("attn.o_a_out", m.o_groups * m.o_lora_rank * A, True),
    ]
    if ratio:
        c = 2 if ratio == 4 else 1
        out.append(ActTerm(f"compressor{ratio}.kv_gate_fp32", 2 * c * d * F, False))
    if ratio == 4:
        di = m.index_head_dim
        out += [ActTerm("indexer.q", m.index_n_heads * di * A, True),
                ActTerm("indexer.kv_gate_fp32", 2 * 2 * di * F, False),
                ActTerm("indexer.topk_idx", m.index_topk * 4, False)]
    return out


def _llama_attention(m: ModelSpec) -> list[ActTerm]:
    h, kv, d = m.num_attention_heads, m.num_kv_heads, m.head_dim
    return [ActTerm("attn.qkv", (h + 2 * kv) * d * A, True),
            ActTerm("attn.core_out_lse", h * d * A + h * F, True)]


def _mlp(m: ModelSpec) -> list[ActTerm]:
    H = m.hidden_size
    if not m.is_moe:
        return [ActTerm("mlp.fc1_act", 3 * m.intermediate_size * A, True)]
    k, I, E = m.num_experts_per_tok, m.moe_intermediate_size, m.n_routed_experts
    out = [
        ActTerm("moe.router_fp32", 2 * E * F, True),
        ActTerm("moe.dispatched", k * H * A, True),
        ActTerm("moe.fc1_act", k * 3 * I * A, True),
        ActTerm("moe.expert_out", k * H * A, True),
    ]
    if m.n_shared_experts:
        out.append(ActTerm("moe.shared_fc1_act", 3 * m.n_shared_experts * I * A, True))
    return out


@lru_cache(maxsize=4096)
def layer_terms(m: ModelSpec, i: int) -> tuple[ActTerm, ...]:
    """Every saved tensor of layer i, per token (see the module docstring); cached."""
    attn = _v4_attention(m, m.layer_kind(i)) if m.family == "deepseek_v4" else _llama_attention(m)
    return tuple(_mhc(m, "attn") + attn + _mhc(m, "mlp") + _mlp(m))


def per_token(terms, tp: int) -> float:
    """Bytes per token on one GPU: split terms / TP + whole terms."""
    return sum(t.bytes_per_token / tp if t.split else t.bytes_per_token for t in terms)


def layer_bytes_per_token(m: ModelSpec, i: int, tp: int) -> float:
    """Full (no recompute) activation bytes per token of layer i on one GPU."""
    return per_token(layer_terms(m, i), tp)


def recompute_bytes_per_token(m: ModelSpec, tp: int) -> float:
    """With full recompute a layer keeps its input only: n*H*2 / TP bytes per token."""
    return m.hc_mult * m.hidden_size * A / tp


def logits_bytes_per_token(m: ModelSpec, tp: int) -> float:
    """Last stage: bf16 logits + fp32 log-softmax over the vocab shard, V/TP * (2 + 4)."""
    return m.vocab_size / tp * (A + F)


def dispatch_bytes_per_token(m: ModelSpec, tp: int) -> float:
    """MoE all-to-all send + receive buffers of the layer being run: 2 * k * H * 2 / TP
    (balanced routing; a skewed router needs more on the hot ranks)."""
    return 2 * m.num_experts_per_tok * m.hidden_size * A / tp if m.is_moe else 0.0
