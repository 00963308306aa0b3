"""Engine vs references: transformers' greedy `generate` token for token, and the trainer's
full-sequence logprobs for the tokens the engine sampled."""

import pytest
import torch
from transformers import DeepseekV4Config as HFConfig
from transformers import DeepseekV4ForCausalLM as HFModel

from conftest import full_sequence_logprobs, greedy, make_engine, prompts, requests, sampled


def hf_twin(model):
    """transformers' DeepseekV4ForCausalLM with the engine model's (served) weights."""
    cfg = HFConfig(**model.config.to_hf_dict())
    cfg._attn_implementation = "eager"
    ref = HFModel(cfg).eval()
    missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing)
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return ref


def test_greedy_equals_transformers_generate():
    engine = make_engine(seed=1, serving_format="bf16")
    ref = hf_twin(engine.model)
    ps = prompts(2, lo=9, hi=21, seed=3)  # past the window (8) and several compressed blocks
    out = engine.generate(requests(ps, greedy(max_new_tokens=16)))
    for p, s in zip(ps, out):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)
        assert s.response_ids.tolist() == hf[0, len(p):].tolist()
        assert s.finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_logprobs_equal_full_sequence_logprobs(temperature):
    engine = make_engine(seed=2, max_prefill_tokens=7)  # prompts prefill in several chunks
    ps = prompts(5, lo=4, hi=26, seed=4)
    params = (lambda i: greedy(max_new_tokens=14)) if temperature == 0 else \
        (lambda i: sampled(seed=i, temperature=temperature, max_new_tokens=14, top_p=0.9, top_k=20))
    for s in engine.generate(requests(ps, params)):
        ref = full_sequence_logprobs(engine.model, s, temperature)
        assert (s.rollout_logprobs - ref).abs().max().item() <= 1e-5
