"""The engine over a dense Llama through its paged KV cache: transformers parity, preemption
under a tiny block budget, prefix sharing of the n samples, weight updates."""

import pytest
import torch
import transformers

from lockstep.config import SamplingParams
from lockstep.engine import GenerateRequest
from lockstep.models.llama import LlamaForCausalLM
from lockstep.models.llama_config import LlamaConfig

from conftest import full_sequence_logprobs, greedy, make_engine, prompts, requests, same_outputs, sampled

CONFIG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type="qwen3")


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def llama_engine(seed=0, **kw):
    kw.setdefault("block_size", 4)
    return make_engine(model=tiny_llama(seed), **kw)


def params(i):
    return greedy(max_new_tokens=10 + i % 4) if i % 2 else sampled(seed=i, max_new_tokens=10 + i % 4)


def test_greedy_equals_transformers_generate():
    engine = llama_engine(1, max_prefill_tokens=8)
    cfg = transformers.AutoConfig.for_model(**CONFIG.to_hf_dict())
    cfg._attn_implementation = "eager"
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    ref.load_state_dict(engine.model.state_dict())
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    ps = prompts(2, lo=5, hi=19, vocab=97, seed=2)
    for p, s in zip(ps, engine.generate(requests(ps, greedy(max_new_tokens=12)))):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)
        assert s.response_ids.tolist() == hf[0, len(p):].tolist()
        assert s.routed_experts is None


def test_logprobs_equal_full_sequence_logprobs():
    engine = llama_engine(3, max_prefill_tokens=5)
    for s in engine.generate(requests(prompts(4, vocab=97, seed=4), lambda i: sampled(i, temperature=0.8))):
        assert (s.rollout_logprobs - full_sequence_logprobs(engine.model, s, 0.8)).abs().max() <= 1e-5


def test_concurrent_and_preempted_equal_one_at_a_time():
    ps = prompts(8, lo=2, hi=30, vocab=97, seed=5)
    alone_engine = llama_engine(6)
    alone = [alone_engine.generate([r])[0] for r in requests(ps, params)]
    same_outputs(llama_engine(6).generate(requests(ps, params)), alone)
    # 30 blocks of 4: room for one max_model_len (96) sequence; growing decodes must preempt
    block_bytes = 2 * CONFIG.num_hidden_layers * 4 * CONFIG.num_key_value_heads * CONFIG.head_dim * 4
    tight = llama_engine(6, cache_memory_bytes=30 * block_bytes)
    preempted = []
    orig = tight.scheduler.schedule
    tight.scheduler.schedule = lambda: (lambda o: (preempted.extend(o.preempted), o)[1])(orig())
    same_outputs(tight.generate(requests(ps, params)), alone)
    assert preempted
    assert tight.cache.num_free_blocks() == 30


def test_n_samples_share_full_prompt_blocks():
    engine = llama_engine(7)
    p = prompts(1, lo=18, hi=19, vocab=97, seed=8)[0]  # 4 full blocks + 2 tokens
    seen = []
    orig = engine.scheduler.fork_parked
    def fork_parked(leader):
        forked = orig(leader)
        seen.append([s.block_table[:] for s in [leader, *forked]])
        return forked

    engine.scheduler.fork_parked = fork_parked
    out = engine.generate([GenerateRequest(p, SamplingParams(n=3, seed=9, max_new_tokens=6))])
    tables = seen[0]
    assert all(t[:4] == tables[0][:4] for t in tables) and len({t[4] for t in tables}) == 3
    fresh = llama_engine(7)
    for i, s in enumerate(out):
        same_outputs([s], fresh.generate([GenerateRequest(p, SamplingParams(seed=9 + i, max_new_tokens=6))]))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_update_equals_fresh_engine(fmt):
    ps = prompts(3, vocab=97, seed=10)
    engine = llama_engine(11, serving_format=fmt)
    new = {k: v.to(torch.bfloat16) for k, v in tiny_llama(12).state_dict().items()}
    engine.update_weights(new, version=2)
    # the update leaves the KV blocks as they were (a recycled block is written before it is read):
    # stale values anywhere in them change nothing
    g = torch.Generator().manual_seed(13)
    for t in (engine.cache.kv.k, engine.cache.kv.v):
        t.copy_(100 * torch.randn(t.shape, generator=g))
    fresh_model = tiny_llama(0)
    fresh_model.load_state_dict({k: v.float() for k, v in new.items()})  # the same (bf16) values
    fresh = make_engine(model=fresh_model, block_size=4, serving_format=fmt)
    same_outputs(engine.generate(requests(ps, params)), fresh.generate(requests(ps, params)), exact=True)
