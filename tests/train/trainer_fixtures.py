"""Shared builders for the trainer tests: tiny DeepSeek-V4 models and synthetic samples."""

from __future__ import annotations

import torch

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_config import CSA, SLIDING
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.sample import Sample


def small_config(**overrides):
    """Two layers (window-only + C4/indexer; hash MoE + top-k MoE): enough kinds, half the cost."""
    base = dict(num_hidden_layers=2, layer_types=(SLIDING, CSA), mlp_layer_types=("hash_moe", "moe"))
    base.update(overrides)
    return tiny_config(**base)


def tiny_model(seed: int = 0, config=None) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config or small_config())
    init_deepseek_v4_(model, seed)
    return model


def make_samples(n: int = 6, seed: int = 1, vocab: int = 96, prompt_len=(3, 6), response_len=(2, 6),
                 routing_shape: tuple[int, int] | None = None, n_experts: int = 6) -> list[Sample]:
    """n samples with random tokens, alternating advantages +1 / -1, zero rollout logprobs, some
    masked tokens; `routing_shape` = (L, k) adds random routed_experts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        r = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=g))
        mask = torch.ones(r, dtype=torch.int64)
        if i % 3 == 2:
            mask[0] = 0
        experts = None
        if routing_shape is not None:
            L, k = routing_shape
            experts = torch.stack([torch.randperm(n_experts, generator=g)[:k].sort().values
                                   for _ in range(r * L)]).view(r, L, k)
        out.append(Sample(prompt_ids=torch.randint(0, vocab, (p,), generator=g),
                          response_ids=torch.randint(0, vocab, (r,), generator=g),
                          rollout_logprobs=torch.zeros(r), loss_mask=mask, routed_experts=experts,
                          advantages=1.0 if i % 2 else -1.0, group_id=i // 2))
    return out
