"""`Sample`: one completion, carried from the rollout engine to the trainer.

This is the narrow seam between rollout and training (DESIGN.md, "The seams"). Everything the
trainer needs to re-score the completion and weight its tokens travels in this one record.

Shapes (P = prompt length, R = response length, L = number of MoE layers, K = experts per token):

    prompt_ids        [P]        int64   prompt token ids (after the chat template)
    response_ids      [R]        int64   sampled token ids, including a final EOS if one was sampled
    rollout_logprobs  [R]        float32 log p_rollout(response_ids[t] | prefix), computed from the
                                         temperature-scaled logits *before* top-p / top-k truncation,
                                         so the trainer can reproduce it from logits / temperature
    loss_mask         [R]        int64   1 = this token is trained on, 0 = it is not (tool output, ...)
    routed_experts    [R, L, K]  int32   optional: row t = the experts chosen at position P - 1 + t (the
                                         forward that sampled response_ids[t]), for routing replay in
                                         the trainer; None when not recorded
    reward            float              filled by the reward function (0.0 until then)
    advantages        float | [R]        filled by the advantage estimator (None until then): a scalar
                                         broadcast over the response, or one value per token
    top_logprobs      [R][k]     list    (token id, logprob) pairs, most likely first: the k likeliest
                                         tokens at each response position under rollout_logprobs'
                                         distribution, where the request asked for them
                                         (SamplingParams.top_logprobs = k, serving); else None
    finish_reason     "stop" | "length" | "abort"
    weight_version    int                version of the weights that sampled the (last) token
    group_id          int                samples drawn from the same prompt share it
    metadata          dict               at least "label", "source" and "index" of the prompt row

Worked example: prompt "What is 2 + 3?" tokenised to [101, 7, 9, 8, 10] (P = 5), the engine
samples "5<eos>" = [12, 2] (R = 2) at temperature 1.0 with token probabilities 0.5 and 0.25:

    Sample(prompt_ids=[101, 7, 9, 8, 10], response_ids=[12, 2],
           rollout_logprobs=[-0.6931, -1.3863], loss_mask=[1, 1],
           finish_reason="stop", weight_version=3, group_id=17,
           metadata={"label": "5", "source": "arithmetic", "index": 42})

After rewarding, `reward = 1.0`; after GRPO over its group, e.g. `advantages = 0.87`.
`num_tokens` is 7, `response_len` is 2, `tokens` is the concatenation [101, 7, 9, 8, 10, 12, 2].
The trainer scores position P - 1 + t to get the logprob of response_ids[t].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

FINISH_REASONS = ("stop", "length", "abort")


def _as_tensor(x: Any, dtype: torch.dtype) -> torch.Tensor:
    # Accept lists from the engine / JSON, but always store tensors of a fixed dtype.
    if isinstance(x, torch.Tensor):
        return x.to(dtype)
    return torch.tensor(list(x), dtype=dtype)


@dataclass
class Sample:
    """One completion; see the module docstring for shapes and a worked example."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    rollout_logprobs: torch.Tensor
    loss_mask: torch.Tensor | None = None  # None -> all ones
    reward: float = 0.0
    finish_reason: str = "stop"
    weight_version: int = 0
    routed_experts: torch.Tensor | None = None
    group_id: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    advantages: float | torch.Tensor | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = _as_tensor(self.prompt_ids, torch.int64)
        self.response_ids = _as_tensor(self.response_ids, torch.int64)
        self.rollout_logprobs = _as_tensor(self.rollout_logprobs, torch.float32)
        r = self.response_ids.numel()
        if self.loss_mask is None:
            self.loss_mask = torch.ones(r, dtype=torch.int64)
        self.loss_mask = _as_tensor(self.loss_mask, torch.int64)
        if self.prompt_ids.dim() != 1 or self.response_ids.dim() != 1:
            raise ValueError("prompt_ids and response_ids must be 1-D")
        if self.rollout_logprobs.shape != (r,) or self.loss_mask.shape != (r,):
            raise ValueError(
                f"rollout_logprobs {tuple(self.rollout_logprobs.shape)} and loss_mask "
                f"{tuple(self.loss_mask.shape)} must both have shape ({r},) like response_ids"
            )
        if self.routed_experts is not None:
            self.routed_experts = _as_tensor(self.routed_experts, torch.int32)
            if self.routed_experts.dim() != 3 or self.routed_experts.shape[0] != r:
                raise ValueError(f"routed_experts must be [R={r}, n_moe_layers, top_k], got {tuple(self.routed_experts.shape)}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if isinstance(self.advantages, torch.Tensor) and self.advantages.dim() > 0 and self.advantages.shape != (r,):
            raise ValueError(f"per-token advantages must have shape ({r},), got {tuple(self.advantages.shape)}")

    @property
    def response_len(self) -> int:
        return self.response_ids.numel()

    @property
    def num_tokens(self) -> int:
        return self.prompt_ids.numel() + self.response_ids.numel()

    @property
    def tokens(self) -> torch.Tensor:
        """prompt_ids followed by response_ids, [P + R]."""
        return torch.cat([self.prompt_ids, self.response_ids])

    def token_advantages(self) -> torch.Tensor:
        """Advantages as a float32 [R] tensor (a scalar is broadcast over the response)."""
        if self.advantages is None:
            raise ValueError("advantages have not been computed for this sample")
        adv = torch.as_tensor(self.advantages, dtype=torch.float32)
        return adv.expand(self.response_len).clone() if adv.dim() == 0 else adv
