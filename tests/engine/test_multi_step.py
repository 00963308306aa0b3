"""Multi-step decode (engine/multi_step.py): K decode steps per host round trip give the outputs
of K single steps (bitwise while the batch is the same; a sequence that stops mid-window stays
in the batch until the window ends, which changes only rounding), read back once, and stop
sequences exactly where single steps would; with async scheduling (the default) the next window
is launched before a window is read back, with the same outputs. Run through the decode graphs'
eager stand-in on the CPU (captured graphs on CUDA)."""

import asyncio
import dataclasses

import pytest
import torch

from lockstep.config import SamplingParams
from lockstep.engine import GenerateRequest
from lockstep.engine import engine as engine_module
from lockstep.engine.multi_step import launch_window, window_steps
from lockstep.engine.request import RequestState
from lockstep.engine.sync_audit import SyncAudit

from conftest import DEVICE, greedy, make_engine, prompts, requests, sampled, start_decoding


def graph_engine(seed, decode_steps, **kw):
    if DEVICE == "cuda":
        kw.setdefault("dtype", "bfloat16")  # captured graphs need torch._grouped_mm's dtype
    engine = make_engine(seed=seed, cuda_graph=False, decode_steps=decode_steps, **kw)
    engine.adapter.enable_graphs(engine.config.max_num_seqs, capture=DEVICE == "cuda", compile_backend=None)
    return engine


def mixed_params(i):
    # stop ids that the tiny model samples now and then: sequences stop in the middle of windows
    stops = (5, 17, 33, 61)
    if i % 3 == 0:
        return greedy(max_new_tokens=5 + 4 * i, stop_token_ids=stops)
    return sampled(seed=70 + i, max_new_tokens=5 + 4 * i, top_p=0.8 if i % 2 else 1.0, top_k=7 if i == 4 else -1,
                   stop_token_ids=stops, return_routed_experts=True)


def identical(a, b, atol=0.0):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.response_ids.tolist() == y.response_ids.tolist()
        assert x.finish_reason == y.finish_reason
        assert torch.allclose(x.rollout_logprobs, y.rollout_logprobs, rtol=0, atol=atol)
        assert (x.routed_experts is None) == (y.routed_experts is None)
        if x.routed_experts is not None:
            assert torch.equal(x.routed_experts, y.routed_experts)


ASYNC = pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])


@ASYNC
def test_windows_equal_single_steps_bitwise_for_the_same_batch(async_scheduling):
    # 6 prompts of 5 tokens prefill in one step (budget 32), then decode together and stop together
    # (16 tokens: the prefill's first, then windows of 8 and 7): every step sees the same batch
    ps = prompts(6, lo=5, hi=6, seed=40)
    params = lambda i: dataclasses.replace(mixed_params(i), max_new_tokens=16, stop_token_ids=())  # noqa: E731
    single = graph_engine(42, decode_steps=1).generate(requests(ps, params))
    multi = graph_engine(42, decode_steps=8, async_scheduling=async_scheduling).generate(requests(ps, params))
    identical(multi, single)


@ASYNC
@pytest.mark.parametrize("max_num_seqs", [16, 4], ids=["all-running", "some-waiting"])
def test_windows_stop_where_single_steps_stop(async_scheduling, max_num_seqs):
    # 4 sequences at a time: the waiting ones join as others stop (the chain of windows breaks then)
    ps = prompts(9, lo=3, hi=40, seed=41)
    single = graph_engine(42, decode_steps=1, max_num_seqs=max_num_seqs).generate(requests(ps, mixed_params))
    multi = graph_engine(42, decode_steps=8, max_num_seqs=max_num_seqs,
                         async_scheduling=async_scheduling).generate(requests(ps, mixed_params))
    identical(multi, single, atol=1e-5 if DEVICE == "cpu" else 2e-2)
    reasons = {s.finish_reason for s in single}
    assert reasons == {"stop", "length"}, reasons  # both kinds of stop happen inside windows


@ASYNC
def test_windows_with_siblings_and_max_model_len(async_scheduling):
    # n = 3 samples fork from one prefill; max_model_len 40 caps windows near the end of the cache
    reqs = lambda: [GenerateRequest(p, SamplingParams(temperature=1.0, seed=9 + i, n=3, max_new_tokens=60))  # noqa: E731
                    for i, p in enumerate(prompts(3, lo=5, hi=25, seed=43))]
    single = graph_engine(44, decode_steps=1, max_model_len=40).generate(reqs())
    multi = graph_engine(44, decode_steps=6, max_model_len=40, async_scheduling=async_scheduling).generate(reqs())
    identical(multi, single)
    assert all(s.finish_reason == "length" and s.prompt_ids.numel() + s.response_len == 40 for s in multi)


def test_window_steps_caps():
    def seq(prompt_len, generated, max_new):
        state = RequestState(GenerateRequest(list(range(1, prompt_len + 1)), greedy(max_new_tokens=max_new)))
        s = state.sequences[0]
        s.tokens += [1] * generated
        return s

    assert window_steps([seq(10, 2, 50), seq(5, 0, 50)], 8, 96) == 8
    assert window_steps([seq(10, 2, 50), seq(90, 3, 50)], 8, 96) == 3  # 93 of 96 positions used
    assert window_steps([seq(10, 2, 5), seq(5, 0, 4)], 8, 96) == 4  # nobody may sample more than 4
    assert window_steps([seq(95, 0, 5)], 8, 96) == 1


def test_a_window_reads_back_once():
    engine = graph_engine(46, decode_steps=4)
    ps = prompts(5, lo=10, hi=40, seed=47)
    params = [greedy(max_new_tokens=30), sampled(seed=1, max_new_tokens=30, top_k=5, return_routed_experts=True)]
    states = start_decoding(engine, requests(ps, lambda i: params[i % 2]))
    before = [q.num_output for s in states for q in s.sequences]
    with SyncAudit() as audit:
        fed = [engine.step() for _ in range(3)]
    assert fed == [5 * 4] * 3  # every step was a window of 4 decode steps
    assert [q.num_output for s in states for q in s.sequences] == [n + 12 for n in before]
    assert audit.counts["sync_ops"] == 0 and audit.counts["h2d_blocking"] == 0
    assert audit.counts["value_reads"] == 3, audit.counts


def test_async_launches_the_next_window_before_reading_one(monkeypatch):
    from lockstep.transfer import HostRead

    engine = graph_engine(46, decode_steps=4)
    states = start_decoding(engine, requests(prompts(5, lo=10, hi=40, seed=47), greedy(max_new_tokens=30)))
    seqs = [q for s in states for q in s.sequences]
    before = [q.num_output for q in seqs]
    log = []
    run, values = engine.adapter.graphs.run, HostRead.values
    monkeypatch.setattr(engine.adapter.graphs, "run", lambda *a: log.append("step") or run(*a))
    monkeypatch.setattr(HostRead, "values", lambda self: log.append("read") or values(self))
    assert engine.step() == 5 * 4
    assert log == ["step"] * 8 + ["read"]  # the second window was queued before the first was read
    assert [q.num_output for q in seqs] == [n + 4 for n in before] and engine._in_flight is not None
    log.clear()
    assert engine.step() == 5 * 4
    assert log == ["step"] * 4 + ["read"]
    # a weight update applies the window in flight first (its tokens came from the weights before)
    log.clear()
    name, weight = next(iter(engine.model.state_dict().items()))
    engine.update_weights([(name, weight.clone())], version=1, partial=True)
    assert log == ["read"] and engine._in_flight is None
    assert [q.num_output for q in seqs] == [n + 12 for n in before]


def test_first_stop_is_where_token_by_token_checks_stop():
    from lockstep.engine.output import StopChecker

    g = torch.Generator().manual_seed(48)
    for trial in range(300):
        eos = (1,) if trial % 2 else ()
        checker = StopChecker(eos, None, max_model_len=int(torch.randint(20, 40, (1,), generator=g)))
        p = SamplingParams(max_new_tokens=int(torch.randint(1, 15, (1,), generator=g)), ignore_eos=trial % 3 == 0,
                           stop_token_ids=tuple(torch.randint(0, 8, (trial % 3,), generator=g).tolist()))
        prompt = torch.randint(2, 8, (int(torch.randint(1, 19, (1,), generator=g)),), generator=g).tolist()
        seq = RequestState(GenerateRequest(prompt, p)).sequences[0]
        seq.tokens += [2] * min(int(torch.randint(0, 6, (1,), generator=g)), p.max_new_tokens - 1,
                                checker.max_model_len - len(prompt) - 1)
        new = torch.randint(0, 8, (8,), generator=g).tolist()
        want = None
        for j, tok in enumerate(new):  # the reference: append one token at a time
            seq.tokens.append(tok)
            reason = checker.check(seq)
            if reason is not None:
                want = (j, reason)
                break
        del seq.tokens[len(seq.tokens) - (j + 1):]
        assert checker.first_stop(seq, new) == want, (trial, p, len(prompt), new)


def test_windows_through_the_background_loop_with_an_abort():
    # concurrent callers join the running batch between windows; an abort lands at a window's end
    ps = prompts(6, lo=3, hi=30, seed=49)
    params = lambda i: greedy(max_new_tokens=40 if i == 0 else 12 + i)  # noqa: E731
    ref = graph_engine(50, decode_steps=1).generate(requests(ps, params))
    engine = graph_engine(50, decode_steps=8)
    reqs = requests(ps, params)

    async def main():
        tasks = [asyncio.ensure_future(engine.generate_async(r)) for r in reqs]
        while reqs[0].request_id not in engine._requests:
            await asyncio.sleep(0.001)
        while engine._requests[reqs[0].request_id].sequences[0].num_output < 10:
            await asyncio.sleep(0.001)
        engine.abort(reqs[0].request_id)
        return await asyncio.gather(*tasks)

    try:
        got = [s for group in asyncio.run(main()) for s in group]
    finally:
        engine.shutdown()
    aborted = got[0]
    assert aborted.finish_reason == "abort" and 10 <= aborted.response_len < 40
    assert aborted.response_ids.tolist() == ref[0].response_ids.tolist()[:aborted.response_len]
    identical(got[1:], ref[1:], atol=1e-5 if DEVICE == "cpu" else 2e-2)


def test_a_request_for_alternatives_decodes_step_by_step_and_samples_the_same(monkeypatch):
    # one sequence asks for top_logprobs: the batch leaves windows (each step's alternatives are read
    # back), every token gets its 4, and what is sampled does not change
    ps = prompts(5, lo=5, hi=6, seed=45)
    params = lambda i: dataclasses.replace(mixed_params(i), max_new_tokens=12, stop_token_ids=(),  # noqa: E731
                                           top_logprobs=4 if i == 1 else 0)
    plain = graph_engine(42, decode_steps=8).generate(
        requests(ps, lambda i: dataclasses.replace(params(i), top_logprobs=0)))
    windows = []
    monkeypatch.setattr(engine_module, "launch_window", lambda *a: windows.append(a) or launch_window(*a))
    asked = graph_engine(42, decode_steps=8).generate(requests(ps, params))
    identical(asked, plain)
    assert windows == []  # all 5 ran to the end together: no window while the asking one ran
    assert [len(a) for a in asked[1].top_logprobs] == [4] * 12
    assert all(s.top_logprobs is None for i, s in enumerate(asked) if i != 1)
    alts = asked[1].top_logprobs
    assert all(a[j][1] >= a[j + 1][1] for a in alts for j in range(3))  # most likely first
    # the sampled token is among its position's 4, or less likely than the 4th
    assert all(t in [x for x, _ in a] or lp <= a[-1][1]
               for a, t, lp in zip(alts, asked[1].response_ids.tolist(), asked[1].rollout_logprobs.tolist()))
