"""Continuous batching: a sequence's outputs do not depend on what else runs, how its prompt is
chunked, whether its siblings share its prefill, or whether it was preempted and recomputed."""

import torch

from lockstep.config import SamplingParams
from lockstep.engine import GenerateRequest

from conftest import greedy, make_engine, prompts, requests, same_outputs, sampled, tiny_dsv4


def params_for(i):
    return greedy(max_new_tokens=10 + i % 5) if i % 2 else sampled(seed=100 + i, max_new_tokens=10 + i % 5, top_p=0.95)


def test_concurrent_requests_equal_one_at_a_time():
    model = tiny_dsv4(5)
    ps = prompts(9, lo=2, hi=40, seed=6)
    together = make_engine(model=model, max_prefill_tokens=24).generate(requests(ps, params_for))
    alone_engine = make_engine(model=tiny_dsv4(5), max_prefill_tokens=24)
    alone = [alone_engine.generate([r])[0] for r in requests(ps, params_for)]
    same_outputs(together, alone)


def test_batch_invariant_mode_is_bitwise_independent_of_the_batch():
    ps = prompts(8, lo=2, hi=40, seed=7)
    engine = make_engine(seed=8, batch_invariant=True, max_prefill_tokens=16)
    batch = engine.generate(requests(ps, params_for))
    alone = [engine.generate([r])[0] for r in requests(ps, params_for)]
    same_outputs(batch, alone, exact=True)


def test_n_samples_share_the_prefill():
    engine = make_engine(seed=9)
    p = prompts(1, lo=20, hi=21, seed=10)[0]
    req = GenerateRequest(p, SamplingParams(temperature=1.0, seed=5, n=4, max_new_tokens=8), group_id=7,
                          metadata={"index": 3})
    fed = []
    orig = engine.runner.execute
    engine.runner.execute = lambda sched: (fed.append(sum(n for _, n in sched)), orig(sched))[1]
    out = engine.generate([req])
    assert len(out) == 4 and all(s.group_id == 7 and s.metadata["index"] == 3 for s in out)
    assert all(s.metadata["request_id"] == req.request_id for s in out)
    assert sum(fed) == len(p) + 4 * 7  # the prompt once, then each sample's own tokens
    assert len({tuple(s.response_ids.tolist()) for s in out}) > 1  # seeds seed + i differ
    # each sample equals the same request with seed + i and n = 1 on a fresh engine
    fresh = make_engine(seed=9)
    for i, s in enumerate(out):
        single = fresh.generate([GenerateRequest(p, SamplingParams(temperature=1.0, seed=5 + i, max_new_tokens=8))])
        same_outputs([s], single)


def test_siblings_without_room_prefill_on_their_own():
    # 2 slots for a request of n = 3: one sibling forks, the last prefills after a slot frees up
    req = GenerateRequest([1, 2, 3, 4, 5], SamplingParams(n=3, seed=1, max_new_tokens=6))
    ref = make_engine(seed=11).generate([req])
    slot = make_engine(seed=11).cache.bytes_per_slot
    tight = make_engine(seed=11, cache_memory_bytes=2 * slot)
    assert tight.cache.num_blocks == 2
    out = tight.generate([GenerateRequest([1, 2, 3, 4, 5], SamplingParams(n=3, seed=1, max_new_tokens=6))])
    same_outputs(out, ref)


def test_tiny_cache_budget_queues_and_gives_the_same_outputs():
    ps = prompts(8, lo=2, hi=30, seed=12)
    ref = make_engine(seed=13).generate(requests(ps, params_for))
    slot = make_engine(seed=13).cache.bytes_per_slot
    tight = make_engine(seed=13, cache_memory_bytes=3 * slot + 7, max_prefill_tokens=5)
    same_outputs(tight.generate(requests(ps, params_for)), ref)


def test_preemption_by_recompute_gives_the_same_outputs():
    ps = prompts(6, lo=2, hi=30, seed=14)
    ref = make_engine(seed=15).generate(requests(ps, params_for))
    engine = make_engine(seed=15)
    states = [engine._new_state(r) for r in requests(ps, params_for)]
    for s in states:
        engine._add(s)
    steps = 0
    while not all(s.done for s in states):
        engine.step()
        steps += 1
        if steps in (3, 8):  # mid-prefill for some, mid-decode for others
            assert engine.scheduler.preempt_all()
            engine.cache.reset_all()
    same_outputs([x for s in states for x in s.samples], ref)


def test_chunked_prefill_respects_the_budget():
    engine = make_engine(seed=16, max_prefill_tokens=6)
    prompt_tokens = []
    orig = engine.scheduler.schedule

    def schedule():
        out = orig()
        prompt_tokens.append(sum(n for s, n in out.scheduled if not (n == 1 and s.num_computed > 0)))
        return out

    engine.scheduler.schedule = schedule
    engine.generate(requests(prompts(4, lo=10, hi=20, seed=17), greedy(max_new_tokens=3)))
    assert max(prompt_tokens) <= 6


def test_routed_experts_are_recorded_per_response_token():
    engine = make_engine(seed=18)
    p = prompts(1, lo=12, hi=13, seed=19)[0]
    s = engine.generate([GenerateRequest(p, greedy(max_new_tokens=5, return_routed_experts=True))])[0]
    c = engine.model.config
    assert s.routed_experts.shape == (5, c.num_hidden_layers, c.num_experts_per_tok)
    from lockstep.models.deepseek_v4 import Routing
    rec = Routing()
    with torch.no_grad():
        engine.model(s.tokens.unsqueeze(0).to(engine.model.lm_head.weight.device), routing=rec)
    full = rec.stacked()[0].cpu()  # [P + R, L, k]
    P = len(p)
    assert torch.equal(s.routed_experts.long(), full[P - 1:P + 4].long())
