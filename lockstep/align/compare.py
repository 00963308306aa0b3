"""Token-level train/rollout agreement: the engine samples, the trainer re-scores the same tokens.

    d_t = |logp_train(t) - logp_rollout(t)|   over response tokens
    mean_abs_diff = mean over samples of (mean over the sample's tokens of d_t)   (Miles' metric)
Also the max, the fraction of tokens that agree bitwise, and the k3 KL estimate. Both sides use
the same definition: log softmax(logits / temperature) over the full vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..engine.request import GenerateRequest


@dataclass
class AlignReport:
    num_samples: int
    num_tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    exact_fraction: float
    kl_k3: float
    diffs: torch.Tensor  # [num_tokens], for histograms

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if k != "diffs"}


def compare(engine, trainer, prompts: list[list[int]], sampling: SamplingParams) -> AlignReport:
    samples = engine.generate([GenerateRequest(prompt_ids=p, sampling=sampling, group_id=i) for i, p in enumerate(prompts)])
    samples = [s for s in samples if s.response_len > 0]
    train_lp = trainer.logprobs(samples)
    per_sample, diffs, kls = [], [], []
    for s, lp in zip(samples, train_lp):
        d = (lp.float().cpu() - s.rollout_logprobs.float()).abs()
        per_sample.append(d.mean())
        diffs.append(d)
        log_ratio = s.rollout_logprobs.float() - lp.float().cpu()  # log p_rollout / p_train
        kls.append((torch.exp(-log_ratio) - 1 + log_ratio).mean())
    flat = torch.cat(diffs) if diffs else torch.zeros(0)
    return AlignReport(
        num_samples=len(samples), num_tokens=flat.numel(),
        mean_abs_diff=float(torch.stack(per_sample).mean()) if per_sample else 0.0,
        max_abs_diff=float(flat.max()) if flat.numel() else 0.0,
        exact_fraction=float((flat == 0).float().mean()) if flat.numel() else 1.0,
        kl_k3=float(torch.stack(kls).mean()) if kls else 0.0, diffs=flat)
