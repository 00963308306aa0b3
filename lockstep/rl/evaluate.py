"""Offline evaluation: n samples per held-out prompt, each set scored by its own reward, pass@k and
truncation ratio. Which reward a set gets is RunConfig.eval_reward's rule (rl/config.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .rollout import RolloutSpec, generate_for, score
from ..eval.pass_at_k import pass_at_k_metrics


@dataclass
class EvalSet:
    prompts: list  # of lockstep.rl.data.Prompt
    reward_fn: object  # fn(response, label) -> float
    reward: str  # the reward's name (RunConfig.eval_reward), for config.json and messages


@dataclass
class SetResult:
    """One set's evaluation: its metrics, and what `lockstep eval` shows of it (rl/eval_report.py)."""

    metrics: dict[str, float]
    samples: list  # of Sample, n per prompt in prompt order, each with .reward filled in
    reward_errors: int  # reward calls that raised or returned a non-finite number
    seconds: float


def evaluate_set(engine, name: str, eval_set: EvalSet, spec: RolloutSpec, tag=("eval",),
                 on_prompt_done=None) -> SetResult:
    """`on_prompt_done`: called as each prompt's samples finish (lockstep eval's progress bar)."""
    start = time.perf_counter()
    samples = generate_for(engine, eval_set.prompts, spec, (*tag, name), 0, on_prompt_done)
    errors = score(samples, eval_set.reward_fn)
    n = spec.n_samples
    groups = [samples[i * n:(i + 1) * n] for i in range(len(eval_set.prompts))]
    metrics = {f"eval/{name}/reward_errors": float(errors)}
    metrics.update(pass_at_k_metrics(name, [[s.reward for s in g] for g in groups],
                                     [[s.finish_reason for s in g] for g in groups]))
    return SetResult(metrics, samples, errors, time.perf_counter() - start)


def evaluate(engine, eval_sets: dict[str, EvalSet], spec: RolloutSpec, tag=("eval",)) -> dict[str, float]:
    """eval_sets: name -> EvalSet. Returns eval/<set>/pass@<k> (k = 1 .. n), eval/<set>/truncated_ratio
    and eval/<set>/reward_errors."""
    metrics = {}
    for name, eval_set in eval_sets.items():
        metrics.update(evaluate_set(engine, name, eval_set, spec, tag).metrics)
    return metrics
