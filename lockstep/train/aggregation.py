"""Loss aggregation: turn per-token values of a micro-batch into a scalar.

Responses are packed: a micro-batch of B samples is one flat tensor of T response tokens, with
`cu_seqlens` [B + 1] (cumulative lengths, cu_seqlens[0] = 0, cu_seqlens[-1] = T) marking where each
sample starts, and a 0/1 `mask` [T] (the loss mask). Let v be the per-token values, m the mask,
i a sample, t a token.

    token_mean:     sum_{i,t} v_it m_it / num_tokens          num_tokens  = sum of m over the GLOBAL batch
    sequence_mean:  sum_i [ sum_t v_it m_it / sum_t m_it ] / num_samples
                                                              num_samples = samples in the GLOBAL batch
    constant:       sum_{i,t} v_it m_it / (num_samples * max_len)          (Dr.GRPO, max_len e.g. the
                                                              rollout max response length)

The normalisers are passed in, never computed from the micro-batch: a global batch split into any
number of micro-batches then gives the same total when the per-micro-batch results are summed (as
gradient accumulation does), so the update does not depend on the split. A sample with no valid
token contributes 0 to sequence_mean (it still counts in num_samples if the caller counted it).
Default mode is token_mean (DAPO's token-level loss).
"""

from __future__ import annotations

from typing import Sequence

import torch

from lockstep.transfer import to_device

AGGREGATIONS = ("token_mean", "sequence_mean", "constant")


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate 1-D tensors; returns (flat [T], cu_seqlens [B + 1] int64)."""
    lengths = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(tensors) + 1, dtype=torch.int64)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
    return flat, cu_seqlens


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sample index of every packed token, [T] int64 (e.g. cu_seqlens [0, 2, 5] -> [0, 0, 1, 1, 1])."""
    cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sample sum of packed values, [B]; differentiable."""
    ids = to_device(segment_ids(cu_seqlens), values.device)
    out = torch.zeros(len(cu_seqlens) - 1, dtype=values.dtype, device=values.device)
    return out.index_add(0, ids, values)


def broadcast_to_tokens(per_sample: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sample values [B] (e.g. advantages) repeated over each sample's tokens, [T]."""
    return per_sample[to_device(segment_ids(cu_seqlens), per_sample.device)]


def _normaliser(x: int | float | torch.Tensor) -> float | torch.Tensor:
    # A tensor normaliser (e.g. all-reduced across ranks) stays a tensor: no device sync.
    if isinstance(x, torch.Tensor):
        return x.clamp_min(1.0)
    return max(float(x), 1.0)


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: int | float | torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / num_tokens, where num_tokens counts valid tokens of the whole global batch."""
    return (values * mask).sum() / _normaliser(num_tokens)


def sequence_mean(
    values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, num_samples: int | float | torch.Tensor
) -> torch.Tensor:
    """Mean over valid tokens within each sample, summed over samples, / global num_samples."""
    per_sample_sum = segment_sum(values * mask, cu_seqlens)
    per_sample_count = segment_sum(mask.to(values.dtype), cu_seqlens).clamp_min(1.0)
    return (per_sample_sum / per_sample_count).sum() / _normaliser(num_samples)


def constant_normalized(
    values: torch.Tensor, mask: torch.Tensor, num_samples: int | float | torch.Tensor, max_len: int
) -> torch.Tensor:
    """Dr.GRPO: sum(values * mask) / (num_samples * max_len), a constant independent of lengths."""
    return (values * mask).sum() / (_normaliser(num_samples) * max_len)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str = "token_mean",
    *,
    num_tokens: int | float | torch.Tensor | None = None,
    num_samples: int | float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Dispatch on `mode` (one of AGGREGATIONS); the global normaliser that mode needs must be given."""
    if mode == "token_mean":
        if num_tokens is None:
            raise ValueError("token_mean needs num_tokens (valid tokens in the global batch)")
        return token_mean(values, mask, num_tokens)
    if mode == "sequence_mean":
        if num_samples is None:
            raise ValueError("sequence_mean needs num_samples (samples in the global batch)")
        return sequence_mean(values, mask, cu_seqlens, num_samples)
    if mode == "constant":
        if num_samples is None or max_len is None:
            raise ValueError("constant (Dr.GRPO) needs num_samples and max_len")
        return constant_normalized(values, mask, num_samples, max_len)
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")
