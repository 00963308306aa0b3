"""Shared helpers of the engine tests: tiny models, engines, and the full-sequence reference."""

import os

import pytest
import torch

from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine import Engine, GenerateRequest
from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny matmuls: OpenMP threads only add spin contention on a shared 2-core machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# the compiled-region tests: mHC's Sinkhorn loop unrolled 20 times is most of a layer's traced ops;
# 2 iterations (a column, a row, a column step) trace the same kinds of ops
FEW_SINKHORN = dict(hc_sinkhorn_iters=2)


def tiny_dsv4(seed=0, **overrides):
    model = DeepseekV4ForCausalLM(tiny_config(**overrides))
    init_deepseek_v4_(model, seed)
    return model.eval()


# LOCKSTEP_TEST_DEVICE=cuda runs the engines (and the references they are compared with) on a GPU
DEVICE = os.environ.get("LOCKSTEP_TEST_DEVICE", "cpu")


def engine_config(**kw):
    # true_on_policy off, as on the CPU: on CUDA its None would pick the true-on-policy forward, which
    # tests/test_true_on_policy.py covers; these tests are of the default path (compiled layers, ...)
    base = dict(max_num_seqs=16, max_model_len=96, max_prefill_tokens=32, device=DEVICE, true_on_policy=False)
    base.update(kw)
    return EngineConfig(**base)


def make_engine(seed=0, model=None, tokenizer=None, **kw):
    return Engine(model if model is not None else tiny_dsv4(seed), engine_config(**kw), tokenizer)


def prompts(n, lo=3, hi=30, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def greedy(max_new_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw)


def sampled(seed, max_new_tokens=12, **kw):
    return SamplingParams(temperature=kw.pop("temperature", 0.9), seed=seed, max_new_tokens=max_new_tokens, **kw)


def requests(prompt_list, params):
    return [GenerateRequest(p, params(i) if callable(params) else params) for i, p in enumerate(prompt_list)]


@torch.no_grad()
def full_sequence_log_softmax(model, sample, temperature):
    """log_softmax(logits / T) over the vocabulary at each response position, from one full
    forward (the trainer's view) -> [response_len, vocab]."""
    ids = sample.tokens.unsqueeze(0).to(model.lm_head.weight.device)
    logits = model(ids)[0].float().cpu()
    P, R = sample.prompt_ids.numel(), sample.response_len
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits[P - 1:P + R - 1] / t, dim=-1)


def full_sequence_logprobs(model, sample, temperature):
    """The response tokens' log_softmax(logits / T) from one full forward."""
    lp = full_sequence_log_softmax(model, sample, temperature)
    return lp.gather(1, sample.response_ids.unsqueeze(1)).squeeze(1)


def start_decoding(engine, reqs):
    """Queue the requests and step until every sequence has sampled its first token -> the states."""
    states = [engine._new_state(r) for r in reqs]
    for s in states:
        engine._add(s)
    while not all(q.num_output >= 1 for s in states for q in s.sequences):
        engine.step()
    return states


def same_outputs(a, b, exact=False, atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.response_ids.tolist() == y.response_ids.tolist()
        assert x.finish_reason == y.finish_reason
        if exact:
            assert torch.equal(x.rollout_logprobs, y.rollout_logprobs)
        else:
            assert torch.allclose(x.rollout_logprobs, y.rollout_logprobs, atol=atol, rtol=0)
