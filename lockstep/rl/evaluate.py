"""Offline evaluation: n samples per held-out prompt, rewards, pass@k and truncation ratio."""

from __future__ import annotations

from .rollout import RolloutSpec, make_requests, score
from ..eval.pass_at_k import pass_at_k_metrics


def evaluate(engine, eval_sets: dict[str, list], reward_fn, spec: RolloutSpec, tag=("eval",)) -> dict[str, float]:
    """eval_sets: name -> list of Prompt. Returns eval/<set>/pass@<k> and eval/<set>/truncated_ratio."""
    metrics = {}
    for name, prompts in eval_sets.items():
        samples = engine.generate(make_requests(prompts, engine.tokenizer, spec, (*tag, name), 0))
        metrics[f"eval/{name}/reward_errors"] = float(score(samples, reward_fn))
        n = spec.n_samples
        groups = [samples[i * n:(i + 1) * n] for i in range(len(prompts))]
        metrics.update(pass_at_k_metrics(name, [[s.reward for s in g] for g in groups],
                                         [[s.finish_reason for s in g] for g in groups]))
    return metrics
