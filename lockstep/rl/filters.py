"""Dynamic sampling (DAPO): drop prompt groups that carry no learning signal, and over-sample.

A group whose rewards all agree (std = 0, e.g. every answer right or every answer wrong) has
all-zero GRPO advantages, so it costs compute and contributes nothing but a dilution of the
normaliser. We drop such groups and keep sampling prompts until the batch holds `target_groups`
groups, or the sampling cap is reached (then train on what we have, to avoid spinning forever on
a set the model has saturated).

    zero_std_ratio = (# groups with max(r) - min(r) <= tol) / (# groups)       tol = 1e-8
    continue sampling  <=>  kept_groups < target_groups  and  sampled_groups < max_sampled_groups

`rollout/zero_std_ratio` is the DESIGN.md metric name.
"""

from __future__ import annotations

from typing import Iterable

import torch

from lockstep.rl.advantages import group_index
from lockstep.sample import Sample


def zero_std_groups(rewards, group_ids, tol: float = 1e-8) -> torch.Tensor:
    """Per-sample bool [N]: True where the sample's group has all-equal rewards (within tol)."""
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    index, g = group_index(r.numel(), group_ids)
    hi = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce(0, index, r, "amax")
    lo = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce(0, index, r, "amin")
    return ((hi - lo) <= tol)[index]


def filter_zero_std(samples: Iterable[Sample], tol: float = 1e-8) -> tuple[list[Sample], dict[str, float]]:
    """Keep samples of groups whose rewards differ; returns (kept, {"rollout/zero_std_ratio": ...})."""
    samples = list(samples)
    if not samples:
        return [], {"rollout/zero_std_ratio": 0.0}
    group_ids = [s.group_id for s in samples]
    flat = zero_std_groups([s.reward for s in samples], group_ids, tol)
    # Ratio over groups, not samples: groups may differ in size after aborts.
    zero_groups = {gid for gid, z in zip(group_ids, flat.tolist()) if z}
    ratio = len(zero_groups) / len(set(group_ids))
    kept = [s for s, z in zip(samples, flat.tolist()) if not z]
    return kept, {"rollout/zero_std_ratio": ratio}


def should_continue_sampling(kept_groups: int, target_groups: int, sampled_groups: int, max_sampled_groups: int | None) -> bool:
    """True while the batch is not full and the over-sampling cap (None = no cap) is not reached."""
    if kept_groups >= target_groups:
        return False
    return max_sampled_groups is None or sampled_groups < max_sampled_groups
