"""Outcome-reward advantage estimators: rewards [N] -> one advantage per sample [N].

Samples of one prompt form a group (same group id; or, with `group_size`, consecutive runs of
that size). For sample i in group g with n_g members, mean_g and std_g are the group's reward mean
and standard deviation (unbiased, Bessel-corrected, as torch.std and the GRPO implementations in
TRL / verl / slime use; a group of one has std 0):

    GRPO     A_i = (r_i - mean_g) / (std_g + eps)                 eps = 1e-6
    Dr.GRPO  A_i = r_i - mean_g                                   (no std division: Liu et al. 2025)
    RLOO     A_i = r_i - mean_{j in g, j != i} r_j = n_g / (n_g - 1) * (r_i - mean_g)   (0 if n_g = 1)
    REINFORCE++          A_i = whiten_tokens(r)_i
    REINFORCE++-baseline A_i = whiten_tokens(r - mean_g)_i
    GSPO     uses the GRPO advantages.

REINFORCE++ whitens over every valid (loss-mask) response token of the batch, as verl
(compute_reinforce_plus_plus[_baseline]_outcome_advantage -> verl.utils.torch_functional.masked_whiten)
and slime (normalize_advantages -> distributed_masked_whiten) do. With a single terminal reward and
gamma = 1 every token's return is its sample's value v_i, so with n_i valid tokens in sample i and
N = sum n_i:

    mean = sum_i n_i v_i / N        var = sum_i n_i (v_i - mean)^2 / (N - 1)   (Bessel over tokens; 0 if N < 2)
    whiten_tokens(v)_i = (v_i - mean) / sqrt(var + 1e-8)                       (the mean is not added back)

Each token of a sample gets the same value, so it stays one scalar per sample, but a long answer
weighs n_i times in the statistics (per-sample whitening would weigh every answer once). Without
token counts every sample counts as one token. A per-token KL-shaped reward (r_t = -beta * KL_t plus
the terminal reward) would give per-token returns and is out of scope here: put a KL loss term in
the trainer instead (losses.kl_penalty).
"""

from __future__ import annotations

from typing import Sequence

import torch

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo")
TOKEN_WHITENED = ("reinforce_pp", "reinforce_pp_baseline")  # their statistics weigh each valid token


def group_index(
    n: int, group_ids: torch.Tensor | Sequence | None = None, group_size: int | None = None
) -> tuple[torch.Tensor, int]:
    """Dense group index [N] in 0..G-1 and G, from group ids (any hashable ints) or a group size."""
    if group_ids is not None:
        ids = torch.as_tensor(group_ids)
        if ids.numel() != n:
            raise ValueError(f"group_ids has {ids.numel()} entries for {n} rewards")
        uniq, inverse = torch.unique(ids, return_inverse=True)
        return inverse, uniq.numel()
    if group_size is None or group_size < 1 or n % group_size:
        raise ValueError(f"need group_ids, or a group_size dividing N={n} (got {group_size})")
    return torch.arange(n) // group_size, n // group_size


def group_stats(rewards: torch.Tensor, index: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, ...]:
    """Per-sample (mean_g, std_g, n_g) gathered back to [N]; std is unbiased, 0 for singleton groups."""
    r = rewards.double()
    count = torch.zeros(num_groups, dtype=torch.float64).index_add(0, index, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add(0, index, r) / count
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add(0, index, (r - mean[index]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1.0))
    return mean[index], std[index], count[index]


def _prepare(rewards, group_ids, group_size):
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    index, g = group_index(r.numel(), group_ids, group_size)
    return r, group_stats(r, index, g)


def grpo_advantages(rewards, group_ids=None, group_size=None, eps: float = 1e-6) -> torch.Tensor:
    r, (mean, std, _) = _prepare(rewards, group_ids, group_size)
    return ((r - mean) / (std + eps)).float()


def dr_grpo_advantages(rewards, group_ids=None, group_size=None) -> torch.Tensor:
    r, (mean, _, _) = _prepare(rewards, group_ids, group_size)
    return (r - mean).float()


def rloo_advantages(rewards, group_ids=None, group_size=None) -> torch.Tensor:
    r, (mean, _, count) = _prepare(rewards, group_ids, group_size)
    scale = torch.where(count > 1, count / (count - 1).clamp_min(1.0), torch.zeros_like(count))
    return (scale * (r - mean)).float()


def whiten_tokens(values: torch.Tensor, token_counts=None, eps: float = 1e-8) -> torch.Tensor:
    """verl's masked_whiten over the batch's valid tokens, for per-sample values [N] that every one of
    a sample's token_counts[i] tokens carries (None: one token each); see the module docstring."""
    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    n = torch.ones_like(v) if token_counts is None else torch.as_tensor(token_counts, dtype=torch.float64).reshape(-1)
    if n.numel() != v.numel():
        raise ValueError(f"token_counts has {n.numel()} entries for {v.numel()} samples")
    total = float(n.sum())
    if total == 0:
        return torch.zeros_like(v)
    mean = (n * v).sum() / total
    var = (n * (v - mean) ** 2).sum() / (total - 1) if total >= 2 else torch.zeros((), dtype=v.dtype)
    return (v - mean) / torch.sqrt(var + eps)


def reinforce_pp_advantages(rewards, group_ids=None, group_size=None, token_counts=None) -> torch.Tensor:
    """Batch whitening over tokens; groups are ignored (the arguments exist for a uniform signature)."""
    return whiten_tokens(rewards, token_counts).float()


def reinforce_pp_baseline_advantages(rewards, group_ids=None, group_size=None, token_counts=None) -> torch.Tensor:
    """Subtract the group mean, then whiten over the batch's tokens."""
    r, (mean, _, _) = _prepare(rewards, group_ids, group_size)
    return whiten_tokens(r - mean, token_counts).float()


_FNS = {
    "grpo": grpo_advantages,
    "gspo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


def compute_advantages(estimator: str, rewards, group_ids=None, group_size=None, token_counts=None) -> torch.Tensor:
    """Advantages [N] float32 with the named estimator (one of ESTIMATORS). token_counts [N], each
    sample's valid response tokens, weigh REINFORCE++'s whitening; the group estimators ignore them."""
    if estimator not in _FNS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")
    extra = {"token_counts": token_counts} if estimator in TOKEN_WHITENED else {}
    return _FNS[estimator](rewards, group_ids=group_ids, group_size=group_size, **extra)
