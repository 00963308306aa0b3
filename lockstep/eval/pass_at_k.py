"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

For a prompt with n samples of which c are correct, the probability that at least one of k samples
drawn without replacement is correct:

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)    (1.0 if n - c < k)

The product form avoids the huge binomials. A sample is correct when its reward is >=
success_threshold (default 1.0, matching the 0/1 built-in rewards). Per set, pass@k is the mean over
prompts, for every k = 1, 2, 3, ... up to the smallest n of any prompt (a reference run's pass@1 and
pass@8 are both there with n = 8; the curve over k shows where extra samples stop paying).
`eval/<set>/truncated_ratio` is the fraction of all samples whose finish_reason is "length".
"""

from __future__ import annotations

from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n samples, c correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def ks_up_to(n: int) -> list[int]:
    """[1, 2, ..., n]: every k that n samples per prompt can estimate."""
    return list(range(1, n + 1))


def pass_at_k_metrics(
    set_name: str,
    rewards: Sequence[Sequence[float]],
    finish_reasons: Sequence[Sequence[str]] | None = None,
    success_threshold: float = 1.0,
) -> dict[str, float]:
    """rewards[p] = rewards of prompt p's samples -> {"eval/<set>/pass@<k>": ..., "eval/<set>/truncated_ratio": ...}."""
    if not rewards or any(len(r) == 0 for r in rewards):
        raise ValueError("need at least one prompt, each with at least one sample")
    n_min = min(len(r) for r in rewards)
    metrics = {}
    for k in ks_up_to(n_min):
        values = [pass_at_k(len(r), sum(x >= success_threshold for x in r), k) for r in rewards]
        metrics[f"eval/{set_name}/pass@{k}"] = sum(values) / len(values)
    if finish_reasons is not None:
        flat = [f for per_prompt in finish_reasons for f in per_prompt]
        metrics[f"eval/{set_name}/truncated_ratio"] = sum(f == "length" for f in flat) / max(len(flat), 1)
    return metrics
