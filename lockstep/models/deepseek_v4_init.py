"""Random initialisation of a DeepSeek-V4 model (tests, the bundled tiny checkpoint).

Unlike a from-scratch training init, every tensor gets non-trivial values — sinks, position
biases, mHC bases, router biases, norm weights — so parity tests exercise every term, and
the hash table `tid2eid` gets k distinct experts per token.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def init_deepseek_v4_(model, seed: int = 0, std: float = 0.02) -> None:
    g = torch.Generator().manual_seed(seed)
    c = model.config

    def randn(shape, scale):
        return torch.randn(shape, generator=g) * scale

    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1.0 + randn(p.shape, 0.1))
        elif name.endswith(".scale") or name.endswith("hc_scale"):
            p.copy_(1.0 + randn(p.shape, 0.1))
        elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
            p.copy_(randn(p.shape, 0.5))
        elif name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:
            p.copy_(randn(p.shape, 4 * std))
        else:
            p.copy_(randn(p.shape, std if "embed" not in name else 1.0))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(c.n_routed_experts, generator=g)[: c.num_experts_per_tok]
                                 for _ in range(c.vocab_size)]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(randn(b.shape, 0.05))


def tiny_config(**overrides):
    """A DeepSeek-V4 config small enough for CPU tests in which every layer kind appears:
    window-only, C4 (overlapping, indexer top-k) and C128-style dense compression, hash and
    top-k MoE, with a window and compress rates small enough that short sequences span many
    blocks and the indexer really selects.

    16 indexer heads: an entry scores exactly 0 only when every head's ReLU is 0, and such
    ties make top-k depend on the kernel's tie order (transformers' topk vs our stable
    sort); with 16 heads that is a 2^-16 event per (query, entry) pair, as in real models."""
    from .deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config

    base = dict(
        vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=6,
        o_groups=2, o_lora_rank=8, index_n_heads=16, index_head_dim=8, index_topk=3, sliding_window=8,
        compress_rates={CSA: 2, HCA: 4}, partial_rotary_factor=0.25,
        layer_types=(SLIDING, CSA, HCA, CSA), mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        compress_rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                               "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1024,
    )
    base.update(overrides)
    return DeepseekV4Config(**base)
