"""Sampler: logprobs before truncation, greedy, top-k / top-p supports, seeded draws that do not
depend on the batch, and one device->host read per call."""

import torch

from lockstep.config import SamplingParams
from lockstep.engine.sampler import Sampler, draw_plan, top_alternatives, truncate_probs, uniform
from lockstep.engine.sync_audit import SyncAudit


def draw(logits, params, seeds, steps=None, rows=None):
    rows = rows if rows is not None else list(range(len(params)))
    steps = steps if steps is not None else [0] * len(params)
    return Sampler()(logits, rows, params, seeds, steps)


def test_logprob_is_temperature_scaled_and_before_truncation():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_k=3, seed=1),
              SamplingParams(temperature=1.3, top_p=0.5, seed=2)]
    tokens, lps = draw(logits, params, [0, 1, 2])
    assert tokens[0] == logits[0].argmax().item()
    for i, (t, temp) in enumerate(zip(tokens, [1.0, 0.6, 1.3])):
        ref = torch.log_softmax(logits[i] / temp, -1)[t].item()
        assert abs(lps[i] - ref) < 1e-6
    assert logits[1].topk(3).indices.tolist().count(tokens[1]) == 1  # drawn inside the top-k


def test_one_temperature_divides_like_the_trainer():
    # all rows at one temperature: x / T with a Python float, bitwise the trainer's token_logprobs
    from lockstep.train.logprobs import token_logprobs

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=0.7, seed=s) for s in range(5)]
    tokens, lps = draw(logits, params, list(range(5)), steps=[3, 1, 4, 1, 5])
    ref = token_logprobs(logits, torch.tensor(tokens), 0.7)
    assert torch.equal(torch.tensor(lps, dtype=torch.float32), ref)


def test_greedy_is_the_first_maximum():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 0.0, 0.0]])
    tokens, lps = draw(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])
    assert tokens == [1, 0]
    assert lps == torch.log_softmax(logits, -1)[[0, 1], [1, 0]].tolist()


def test_truncation_supports():
    probs = torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1]])
    assert truncate_probs(probs, [2], [1.0]).nonzero()[:, 1].tolist() == [1, 2]
    assert truncate_probs(probs, [-1], [0.7]).nonzero()[:, 1].tolist() == [1, 2]
    assert truncate_probs(probs, [-1], [0.71]).nonzero()[:, 1].tolist() == [1, 2, 3]
    assert truncate_probs(probs, [-1], [0.01]).nonzero()[:, 1].tolist() == [1]  # the top token stays


def test_samples_follow_the_distribution_within_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.8)
    n = 4000
    tokens, _ = draw(logits, [p] * n, [3] * n, steps=list(range(n)), rows=[0] * n)  # one stream, n steps
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    assert counts[2:].sum() == 0
    assert abs(counts[0].item() / n - 0.625) < 0.03


def test_uniform_is_a_counter_based_stream():
    u = [uniform(7, t) for t in range(2000)]
    assert u == [uniform(7, t) for t in range(2000)]  # a pure function of (seed, t)
    assert all(0.0 < x < 1.0 for x in u)
    assert abs(sum(u) / len(u) - 0.5) < 0.02
    assert len(set(u)) == len(u) and uniform(8, 0) != uniform(7, 0)


def test_draws_depend_only_on_the_sequence_seed_and_token_index():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_k=20 if s % 2 else -1, seed=s) for s in range(6)]
    steps = [0, 5, 2, 9, 1, 3]
    batch, batch_lp = draw(logits, params, list(range(6)), steps)  # every row samples: no argmax computed
    assert not draw_plan(params).greedy and draw_plan(params + [SamplingParams(temperature=0.0)]).greedy
    alone = [draw(logits[i:i + 1], [params[i]], [i], [steps[i]]) for i in range(6)]
    assert batch == [a[0][0] for a in alone]
    assert batch_lp == [a[1][0] for a in alone]
    # another batch composition: reversed order, greedy rows mixed in
    order = [5, 4, 3, 2, 1, 0]
    mixed_logits = torch.cat([logits[order], logits[:2]])
    mixed, _ = draw(mixed_logits, [params[i] for i in order] + [SamplingParams(temperature=0.0)] * 2,
                    order + [0, 0], [steps[i] for i in order] + [0, 0])
    assert mixed[:6] == [batch[i] for i in order]
    # rows can be shared: two sequences drawing from one row with different seeds
    shared, _ = draw(logits, params[:2], [0, 1], [0, 0], rows=[3, 3])
    assert shared == [draw(logits[3:4], [params[0]], [0])[0][0], draw(logits[3:4], [params[1]], [1])[0][0]]


def test_a_call_reads_the_device_once():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5, top_k=4, seed=2), SamplingParams(temperature=0.9, seed=3)]
    with SyncAudit() as audit:
        draw(logits, params, [1, 0, 2, 3], [0, 0, 7, 2], rows=[0, 1, 2, 2])
    assert audit.syncs == 1 and audit.counts["value_reads"] == 1


def test_vectorised_uniforms_are_bitwise_the_scalar_ones():
    from lockstep.engine.sampler import uniforms

    g = torch.Generator().manual_seed(9)
    seeds = [0, 1, -5, 2**62 + 17, 2**64 - 1] + torch.randint(0, 2**62, (20,), generator=g).tolist()
    steps = [[0] * len(seeds), list(range(len(seeds))), [10**6 + 3 * i for i in range(len(seeds))]]
    got = uniforms(seeds, steps)  # seeds broadcast over the rows of steps
    want = [[uniform(s, t) for s, t in zip(seeds, row)] for row in steps]
    assert got.tolist() == want


def test_table_rows_for_k_draws():
    # row i of draw k: its logits row, T, u(seed, first + k) or -1 when greedy, top_k, top_p
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=4, seed=3),
              SamplingParams(temperature=1.2, top_p=0.7, seed=5)]
    seeds, first = [11, 3, 5], [0, 7, 2]
    table = Sampler.table([2, 0, 1], params, seeds, first, K=4)
    for k in range(4):
        assert table[k].tolist() == [[2, 1.0, -1.0, -1, 1.0], [0, 0.8, uniform(3, 7 + k), 4, 1.0],
                                     [1, 1.2, uniform(5, 2 + k), -1, 0.7]]


def test_top_alternatives_are_the_likeliest_tokens_of_each_sequences_distribution():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 3
    # rows [0, 1, 1, 2]: two sequences share row 1 (a prompt's n samples); one asks for nothing
    params = [SamplingParams(temperature=0.0, top_logprobs=3), SamplingParams(temperature=0.5, top_logprobs=1, seed=1),
              SamplingParams(temperature=0.5), SamplingParams(temperature=1.7, top_k=2, top_logprobs=20, seed=2)]
    rows = [0, 1, 1, 2]
    with SyncAudit() as audit:
        alts = top_alternatives(logits, rows, params)
    assert audit.syncs == 1
    assert alts[2] == [] and [len(a) for a in alts] == [3, 1, 0, 20]
    for a, r, temp in ((alts[0], 0, 1.0), (alts[1], 1, 0.5), (alts[3], 2, 1.7)):
        ref = torch.log_softmax(logits[r] / temp, -1).topk(len(a))  # before top-k truncation, as the logprob
        assert [t for t, _ in a] == ref.indices.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in a]), ref.values, atol=1e-6, rtol=0)
    # greedy: the first alternative is the sampled token with its logprob, bit for bit
    tokens, lps = draw(logits, params, [0, 1, 2, 3], rows=rows)
    assert alts[0][0] == (tokens[0], lps[0])
    assert top_alternatives(logits, rows, [SamplingParams()] * 4) is None


def test_one_temperature_alternatives_hold_the_sampled_logprob_bitwise():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6)) * 2
    params = [SamplingParams(temperature=0.8, seed=s, top_logprobs=20) for s in range(4)]
    tokens, lps = draw(logits, params, list(range(4)))
    for alts, tok, lp in zip(top_alternatives(logits, list(range(4)), params), tokens, lps):
        assert (tok, lp) in alts  # 20 of 30 tokens: the sampled one is among them here
