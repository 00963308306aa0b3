"""Offline evaluation: n samples per held-out prompt, each set scored by its own reward, pass@k and
truncation ratio. Which reward a set gets is RunConfig.eval_reward's rule (rl/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .rollout import RolloutSpec, make_requests, score
from ..eval.pass_at_k import pass_at_k_metrics


@dataclass
class EvalSet:
    prompts: list  # of lockstep.rl.data.Prompt
    reward_fn: object  # fn(response, label) -> float
    reward: str  # the reward's name (RunConfig.eval_reward), for config.json and messages


def evaluate(engine, eval_sets: dict[str, EvalSet], spec: RolloutSpec, tag=("eval",)) -> dict[str, float]:
    """eval_sets: name -> EvalSet. Returns eval/<set>/pass@<k> (k = 1 .. n), eval/<set>/truncated_ratio
    and eval/<set>/reward_errors."""
    metrics = {}
    for name, eval_set in eval_sets.items():
        prompts = eval_set.prompts
        samples = engine.generate(make_requests(prompts, engine.tokenizer, spec, (*tag, name), 0))
        metrics[f"eval/{name}/reward_errors"] = float(score(samples, eval_set.reward_fn))
        n = spec.n_samples
        groups = [samples[i * n:(i + 1) * n] for i in range(len(prompts))]
        metrics.update(pass_at_k_metrics(name, [[s.reward for s in g] for g in groups],
                                         [[s.finish_reason for s in g] for g in groups]))
    return metrics
