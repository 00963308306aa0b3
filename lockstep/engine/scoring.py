"""Prompt logprobs: how likely the served model finds each token of a prompt given the ones before
it (OpenAI completions' `echo` with `logprobs`, what evaluation harnesses score answers by).

One full forward of the served weights over the prompt (the model's own `forward`, no cache), then
the sampler's logprob definition (sampler.scaled_logprobs: log_softmax(logits / T) over the whole
vocabulary, T = 1 for greedy) at every position: logprob i is token i + 1's given tokens 0..i, and
the k likeliest tokens there where k > 0 (sampler.top_alternatives). The engine runs it between
its steps (Engine.prompt_logprobs); the prompt's logits are [P, V] fp32 in one piece, so a long
prompt on a large vocabulary costs its P x V x 4 bytes once. Under the true-on-policy forward a
prompt + answer scores the answer with the bits it was sampled with (tests/engine/test_server_echo.py;
one H100, 2026-12-06: bf16, CUDA graphs, 8-step windows, 40 tokens greedy and sampled, bitwise);
otherwise to rounding, as the trainer's re-scoring.
"""

from __future__ import annotations

import dataclasses

import torch

from lockstep.config import SamplingParams
from lockstep.engine.sampler import logprob_temperature, scaled_logprobs, top_alternatives


@torch.no_grad()
def prompt_logprobs(model, device, prompt_ids: list[int], sampling: SamplingParams
                    ) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """(the logprobs of prompt tokens 1..P-1, [P - 1]; their top_logprobs alternatives or None)."""
    if len(prompt_ids) < 2:
        return [], ([] if sampling.top_logprobs else None)
    ids = torch.tensor([prompt_ids], device=device)
    logits = model(ids)[0, :-1].float()  # position i predicts token i + 1
    targets = ids[0, 1:]
    chosen = scaled_logprobs(logits, logprob_temperature(sampling)).gather(1, targets.unsqueeze(1)).squeeze(1)
    rows = list(range(logits.shape[0]))
    per_row = [dataclasses.replace(sampling, n=1)] * len(rows)
    return chosen.double().tolist(), top_alternatives(logits, rows, per_row)
