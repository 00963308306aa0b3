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
    ref = HFModel(cfg).eval().to(model.lm_head.weight.device)  # same device: same float arithmetic
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
            hf = ref.generate(torch.tensor([p], device=ref.device), max_new_tokens=16, do_sample=False)
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


def test_bundled_model_greedy_equals_transformers_from_the_same_directory():
    from lockstep.config import EngineConfig
    from lockstep.engine import Engine, GenerateRequest
    from lockstep.rl.embedded import ASSET_DIR
    from transformers import AutoModelForCausalLM

    engine = Engine.from_pretrained(ASSET_DIR, EngineConfig(max_num_seqs=4, max_model_len=64))
    ref = AutoModelForCausalLM.from_pretrained(ASSET_DIR, dtype=torch.float32, attn_implementation="eager").eval()
    prompt_ids = [engine.tokenize_prompt(f"What is {a} + {b}?") for a, b in ((23, 58), (71, 19), (40, 44))]
    out = engine.generate([GenerateRequest(prompt_ids=p, sampling=greedy(max_new_tokens=6)) for p in prompt_ids])
    eos = engine.tokenizer.eos_token_id
    for p, s in zip(prompt_ids, out):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        assert s.response_ids.tolist() == hf[0, len(p):].tolist()
