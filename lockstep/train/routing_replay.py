"""Rollout routing replay (R3): the trainer routes response tokens to the experts the engine used.

A `Sample` carries `routed_experts` [R, L, k]; as the engine records it, row t is the routing
(every MoE layer) of input position P - 1 + t, i.e. of the forward that produced the logits of
response token t. Those are exactly the positions whose logits the loss uses. The model takes
`Routing(forced=[b, S, L, k])` over its padded [b, S] layout, forcing every position. The other
prompt positions have no rollout record, so they keep the model's own choice: a no-grad forward
over the prompts alone (each distinct prompt once; causal, so a prompt's routing does not depend
on its response) supplies it. The forced tensor of micro-batch row j is then

    forced[j, :P_j - 1]            = own routing of prompt j
    forced[j, P_j - 1:P_j - 1 + R_j] = samples[j].routed_experts
    forced[j, P_j - 1 + R_j:]      = 0..k-1 (the last response token, and padding: their outputs
                                     reach no logit the loss uses, causality keeps them from others)
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lockstep.models.deepseek_v4 import Routing
from lockstep.sample import Sample
from lockstep.train.aggregation import pack
from lockstep.train.logprobs import MicroBatch, forward_packed


def _routing_shape(model: nn.Module) -> tuple[int, int]:
    c = model.config
    return c.num_hidden_layers, c.num_experts_per_tok


@torch.no_grad()
def prompt_routing(model: nn.Module, prefixes: Sequence[torch.Tensor], device,
                   always_forward: bool = False) -> list[torch.Tensor]:
    """The model's own experts for each token sequence, [P_i, L, k] int64 each (distinct sequences
    run once; empty ones give [0, L, k]). always_forward: run a forward even when every sequence is
    empty (over one token, its routing unused): data-parallel ranks must run the same forwards, since
    FSDP gathers parameters and expert parallelism exchanges tokens inside every one."""
    num_layers, k = _routing_shape(model)
    keys = [tuple(p.tolist()) for p in prefixes]
    unique = [key for key in dict.fromkeys(keys) if key]
    own = {(): torch.zeros(0, num_layers, k, dtype=torch.int64, device=device)}
    if not unique and always_forward:
        forward_packed(model, torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([0, 1]), Routing())
    if unique:
        ids, cu = pack([torch.tensor(key, dtype=torch.int64) for key in unique])
        routing = Routing()
        forward_packed(model, ids.to(device), cu, routing)
        stacked = routing.stacked()  # [n_unique, P_max, L, k]
        own.update({key: stacked[i, :len(key)].long() for i, key in enumerate(unique)})
    return [own[key] for key in keys]


def replay_routing(model: nn.Module, mb: MicroBatch, samples: Sequence[Sample], device,
                   always_forward: bool = False) -> Routing:
    """`Routing` forcing the micro-batch's response tokens to their rollout experts (always_forward:
    see `prompt_routing`)."""
    num_layers, k = _routing_shape(model)
    chosen = [samples[i] for i in mb.indices]
    for i, s in zip(mb.indices, chosen):
        if s.routed_experts is None:
            raise ValueError(f"sample {i} has no routed_experts; routing replay needs them from the engine")
        if tuple(s.routed_experts.shape[1:]) != (num_layers, k):
            raise ValueError(f"sample {i}: routed_experts is {tuple(s.routed_experts.shape)}, "
                             f"expected [R, {num_layers}, {k}]")
    own = prompt_routing(model, [s.prompt_ids[:-1] for s in chosen], device, always_forward)
    return Routing(forced=forced_experts(chosen, own, num_layers, k, device))


def forced_experts(chosen: Sequence[Sample], own: Sequence[torch.Tensor], num_layers: int, k: int,
                   device) -> torch.Tensor:
    """The forced experts [b, S, L, k] of micro-batch samples `chosen` (module docstring), given the
    model's own routing of their prompts (`own`, [P_i - 1, L, k] each)."""
    seq_len = max(s.num_tokens for s in chosen)
    forced = torch.arange(k, device=device).expand(len(chosen), seq_len, num_layers, k).clone()
    for j, (s, prompt_experts) in enumerate(zip(chosen, own)):
        p = s.prompt_ids.numel()
        forced[j, :p - 1] = prompt_experts
        forced[j, p - 1:p - 1 + s.response_len] = s.routed_experts.to(device=device, dtype=torch.int64)
    return forced


def response_experts(routing: Routing, mb: MicroBatch) -> list[torch.Tensor]:
    """After a forward over `mb`, the experts of the positions that predict each response token
    (P - 1 + t, the engine's convention), [R_i, L, k] each."""
    stacked = routing.stacked()  # [b, S, L, k]
    return [stacked[j, p - 1:p - 1 + r].to(torch.int32).cpu()
            for j, (p, r) in enumerate(zip(mb.prompt_lens, mb.response_lens))]
