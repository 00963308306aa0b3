"""Token sampling: temperature, top-k, top-p, greedy, per-request seeds, and the rollout logprob.

For each row of fp32 logits x [V] and its sequence's SamplingParams:

    T        = temperature, or 1 when temperature == 0 (greedy)
    logp     = log_softmax(x / T) over the FULL vocabulary, in fp32
    greedy:  token = argmax(x)  (the first maximum)
    sampled: p = exp(logp), zeroed outside the top-k and outside the top-p nucleus,
             token = argmax(p / E) with E ~ Exponential(1)^V from the sequence's own generator
    returns (token, logp[token])  -- the logprob is taken BEFORE top-k / top-p truncation

argmax(p / E) (the "exponential race", equivalent to Gumbel-max) draws token i with probability
p_i / sum(p), needs no renormalisation after truncation and consumes exactly V draws per step
from the sequence's generator, so a sequence's samples depend only on its seed and its own
logits, never on what else is in the batch or on its truncation settings.
"""

from __future__ import annotations

import torch

from lockstep.config import SamplingParams


def rollout_logprobs(logits_MV: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """log_softmax(logits / T) in fp32, row by row temperature (0 -> 1)."""
    t = torch.tensor([x if x > 0 else 1.0 for x in temperatures], dtype=torch.float32, device=logits_MV.device)
    return torch.log_softmax(logits_MV.float() / t.unsqueeze(1), dim=-1)


def truncate_probs(probs_MV: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p nucleus (the most likely token always stays)."""
    if all(k < 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return probs_MV
    V = probs_MV.shape[-1]
    sorted_p, order = torch.sort(probs_MV, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=probs_MV.device).unsqueeze(0)
    k = torch.tensor([x if x > 0 else V for x in top_k], device=probs_MV.device).unsqueeze(1)
    p = torch.tensor(top_p, dtype=torch.float32, device=probs_MV.device).unsqueeze(1)
    # mass strictly before this token already reaches top_p -> the token is outside the nucleus
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop_sorted = (rank >= k) | ((before >= p) & (rank > 0))
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return probs_MV.masked_fill(drop, 0.0)


class Sampler:
    """Samples one token for each (row, sequence) pair; several sequences may share a row
    (the n samples of a prompt all draw their first token from the leader's prefill logits)."""

    def __call__(self, logits_MV: torch.Tensor, rows: list[int], params: list[SamplingParams],
                 generators: list[torch.Generator]) -> tuple[list[int], list[float]]:
        if not rows:
            return [], []
        x = logits_MV[torch.tensor(rows, device=logits_MV.device)].float()
        logp = rollout_logprobs(x, [p.temperature for p in params])
        tokens = x.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if sampled:
            tokens[sampled] = self._sample(logp[sampled], [params[i] for i in sampled],
                                           [generators[i] for i in sampled])
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens.tolist(), chosen.tolist()

    @staticmethod
    def _sample(logp_MV: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
        probs = truncate_probs(logp_MV.exp(), [p.top_k for p in params], [p.top_p for p in params])
        noise = torch.empty_like(probs)
        for i, g in enumerate(generators):
            noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)
