"""OpenAI completions' `echo` (engine/scoring.py): the prompt's text before the completion and, with
logprobs, every prompt token's logprob given the ones before it, as evaluation harnesses score
answers (`max_tokens: 0` scores the prompt alone). Scoring a prompt + an answer gives the answer the
logprobs the engine recorded while sampling it: to fp32 rounding (a full forward, not decode steps), and
bit for bit under the true-on-policy forward (on CUDA too: LOCKSTEP_TEST_DEVICE=cuda)."""

import pytest
import torch
from openai import OpenAI

from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine import Engine, GenerateRequest

from conftest import DEVICE, tiny_dsv4
from test_server import engine, new_engine, served  # noqa: F401 (the server's fixtures, one per module)

TEXT = "<|user|>What is 23 + 58?<|assistant|>"


def test_scoring_an_answer_gives_the_logprobs_it_was_sampled_with():
    reference = new_engine()
    ids = reference.tokenize_prompt("What is 40 + 41?")
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=12), SamplingParams(temperature=0.7, seed=5,
                                                                                   max_new_tokens=12)):
        (s,) = reference.generate([GenerateRequest(ids, sp)])
        lps, alts = reference.prompt_logprobs(ids + s.response_ids.tolist(), sp)
        assert alts is None and len(lps) == len(ids) + s.response_len - 1
        # the same positions by a full forward instead of prefill + decode steps: equal to fp32 rounding
        assert torch.allclose(torch.tensor(lps[len(ids) - 1:], dtype=torch.float32), s.rollout_logprobs,
                              atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_true_on_policy_scores_an_answer_with_the_bits_it_was_sampled_with(dtype):
    # the true-on-policy forward (models/deepseek_v4_rows.py) gives every row the same bits whatever
    # the batch and the path: a full forward reproduces the chunked prefill + decode steps exactly
    exact = Engine(tiny_dsv4(3), EngineConfig(max_num_seqs=3, max_model_len=48, max_prefill_tokens=5, dtype=dtype,
                                              device=DEVICE, true_on_policy=True))
    prompt = list(range(3, 14))
    sampling = SamplingParams(temperature=0.9, seed=3, max_new_tokens=16, ignore_eos=True)
    (s,) = exact.generate([GenerateRequest(prompt, sampling)])
    lps, _ = exact.prompt_logprobs(prompt + s.response_ids.tolist(), sampling)
    assert torch.equal(torch.tensor(lps[len(prompt) - 1:], dtype=torch.float32), s.rollout_logprobs)


def test_echo_scores_the_prompt_alone(served, engine):
    client = OpenAI(base_url=f"{served.url}/v1", api_key="x")
    ids = engine.tokenize_prompt(TEXT, chat_template=False)
    r = client.completions.create(model="m", prompt=TEXT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    (c,) = r.choices
    assert c.text == TEXT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lps, alts = engine.prompt_logprobs(ids, SamplingParams(temperature=0.0, top_logprobs=2))
    assert c.logprobs.tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert c.logprobs.token_logprobs == [None] + lps and c.logprobs.top_logprobs[0] is None
    assert [len(a) for a in c.logprobs.top_logprobs[1:]] == [2] * (len(ids) - 1)
    assert all(max(a.values()) >= lp for a, lp in zip(c.logprobs.top_logprobs[1:], lps))
    offsets = c.logprobs.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], c.logprobs.tokens))


def test_echo_puts_the_prompt_before_the_completion(served, engine):
    client = OpenAI(base_url=f"{served.url}/v1", api_key="x")
    ids = engine.tokenize_prompt(TEXT, chat_template=False)
    for prompt, shown in (([ids, ids], engine.tokenizer.decode(ids, skip_special_tokens=False)), (TEXT, TEXT)):
        plain = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
        echoed = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                           echo=True)
        for p, e in zip(plain.choices, echoed.choices, strict=True):  # token ids: decoded; text: as given
            assert e.text == shown + p.text
            assert e.logprobs.tokens[len(ids):] == p.logprobs.tokens  # the same answer, after the prompt's tokens
            assert torch.allclose(torch.tensor(e.logprobs.token_logprobs[len(ids):]),
                                  torch.tensor(p.logprobs.token_logprobs), atol=1e-5, rtol=0)
            assert [list(a) for a in e.logprobs.top_logprobs[len(ids):]] == [list(a) for a in p.logprobs.top_logprobs]
            assert e.logprobs.top_logprobs[0] is None and len(e.logprobs.tokens) == len(ids) + len(p.logprobs.tokens)
    no_logprobs = client.completions.create(model="m", prompt=TEXT, max_tokens=6, temperature=0, echo=True)
    assert no_logprobs.choices[0].text == echoed.choices[0].text and no_logprobs.choices[0].logprobs is None


def test_echo_is_not_streamed(served):
    r = served.http.post("/v1/completions", json={"prompt": "12", "echo": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
