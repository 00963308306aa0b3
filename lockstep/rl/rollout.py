"""One rollout: prompts -> engine samples -> rewards, with optional dynamic sampling.

Requests carry seeds derived from (run seed, rollout id, round, prompt slot), so a resumed run
samples exactly what an uninterrupted one would. With dynamic sampling, groups whose rewards
all agree carry no GRPO signal and are dropped; more prompts are drawn until the batch is full
or `max_sampling_rounds` is reached (DAPO's over-sampling, with a cap).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from ..config import SamplingParams
from ..engine.request import GenerateRequest, PromptTooLong
from ..prompt_encoding import encode_prompt
from .data import DataError
from .filters import filter_zero_std, should_continue_sampling
from .rewards import safe_reward
from ..sample import Sample


def derive_seed(*parts) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class RolloutSpec:
    n_samples: int
    temperature: float
    top_p: float
    max_response_len: int
    apply_chat_template: bool
    seed: int
    routed_experts: bool = False  # ask the engine for each token's experts (the trainer's routing replay)


def make_requests(prompts, tokenizer, spec: RolloutSpec, tag: tuple, group_base: int) -> list[GenerateRequest]:
    requests = []
    for i, p in enumerate(prompts):
        sampling = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, n=spec.n_samples,
                                  max_new_tokens=spec.max_response_len, seed=derive_seed(spec.seed, *tag, i),
                                  return_routed_experts=spec.routed_experts)
        requests.append(GenerateRequest(prompt_ids=encode_prompt(tokenizer, p.prompt, spec.apply_chat_template),
                                        sampling=sampling, group_id=group_base + i, metadata=p.sample_metadata()))
    return requests


def generate_for(engine, prompts, spec: RolloutSpec, tag: tuple, group_base: int, on_prompt_done=None) -> list[Sample]:
    """engine.generate of the prompts' requests (make_requests); a prompt too long for the engine's
    context is an error naming its file and line. `on_prompt_done`: Engine.generate's on_request_done."""
    requests = make_requests(prompts, engine.tokenizer, spec, tag, group_base)
    try:
        if on_prompt_done is not None:  # one Engine's (lockstep eval); replicas and EP engines take no callback
            return engine.generate(requests, on_request_done=on_prompt_done)
        return engine.generate(requests)
    except PromptTooLong as e:
        prompt = next(p for p, r in zip(prompts, requests) if r is e.request)
        raise DataError(f"{prompt.location()}: {e}; raise --max-model-len, or leave such prompts out "
                        f"(--max-prompt-len N drops those over N tokens at the start)") from None


def score(samples: list[Sample], reward_fn) -> int:
    """Fill sample.reward from the decoded response; returns how many reward calls failed."""
    errors = 0
    for s in samples:
        s.reward, failed = safe_reward(reward_fn, s.metadata.get("text", ""), s.metadata.get("label", ""))
        errors += failed
    return errors


def generate_rollout(engine, source, reward_fn, *, batch_size: int, spec: RolloutSpec, rollout_id: int,
                     dynamic_sampling: bool, max_rounds: int) -> tuple[list[Sample], dict[str, float]]:
    start = time.perf_counter()
    kept, drawn, errors, zero_std = [], [], 0, []
    max_groups = batch_size * (max_rounds if dynamic_sampling else 1)  # prompts drawn at most
    rnd = 0
    while should_continue_sampling(len({s.group_id for s in kept}), batch_size, rnd * batch_size, max_groups):
        prompts = source.next_batch(batch_size)
        samples = generate_for(engine, prompts, spec, (rollout_id, rnd), (rollout_id * max_rounds + rnd) * batch_size)
        errors += score(samples, reward_fn)
        drawn += samples
        filtered, m = filter_zero_std(samples)
        zero_std.append(m["rollout/zero_std_ratio"])
        kept += filtered if dynamic_sampling else samples
        rnd += 1
    if dynamic_sampling:
        kept = kept[: batch_size * spec.n_samples]
    return kept, rollout_metrics(drawn, kept, errors, zero_std, time.perf_counter() - start)


def rollout_metrics(drawn, kept, errors, zero_std, seconds) -> dict[str, float]:
    n = max(len(drawn), 1)
    tokens = sum(s.response_len for s in drawn)
    return {
        "rollout/raw_reward": sum(s.reward for s in drawn) / n,
        "rollout/response_len": tokens / n,
        "rollout/truncated_ratio": sum(s.finish_reason == "length" for s in drawn) / n,
        "rollout/zero_std_ratio": sum(zero_std) / max(len(zero_std), 1),
        "rollout/reward_errors": float(errors),
        "rollout/num_samples": float(len(kept)),
        "perf/rollout_time": seconds,
        "perf/tokens_per_s": tokens / max(seconds, 1e-9),
    }
