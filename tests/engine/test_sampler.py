"""Sampler: logprobs before truncation, greedy, top-k / top-p supports, seeded and batch-free draws."""

import torch

from lockstep.config import SamplingParams
from lockstep.engine.request import seeded_generator
from lockstep.engine.sampler import Sampler, truncate_probs


def draw(logits, params, seeds, rows=None):
    rows = rows if rows is not None else list(range(len(params)))
    gens = [seeded_generator(s, 0, "cpu") for s in seeds]
    return Sampler()(logits, rows, params, gens)


def test_logprob_is_temperature_scaled_and_before_truncation():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_k=3, seed=1),
              SamplingParams(temperature=1.3, top_p=0.5, seed=2)]
    tokens, lps = draw(logits, params, [0, 1, 2])
    assert tokens[0] == logits[0].argmax().item()
    for i, (t, temp) in enumerate(zip(tokens, [1.0, 0.6, 1.3])):
        ref = torch.log_softmax(logits[i] / temp, -1)[t].item()
        assert abs(lps[i] - ref) < 1e-6


def test_truncation_supports():
    probs = torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1]])
    assert truncate_probs(probs, [2], [1.0]).nonzero()[:, 1].tolist() == [1, 2]
    assert truncate_probs(probs, [-1], [0.7]).nonzero()[:, 1].tolist() == [1, 2]
    assert truncate_probs(probs, [-1], [0.71]).nonzero()[:, 1].tolist() == [1, 2, 3]
    assert truncate_probs(probs, [-1], [0.01]).nonzero()[:, 1].tolist() == [1]  # the top token stays


def test_samples_follow_the_distribution_within_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.8)
    g = seeded_generator(3, 0, "cpu")
    counts = torch.zeros(4)
    for _ in range(4000):
        t, _ = Sampler()(logits, [0], [p], [g])
        counts[t[0]] += 1
    freq = counts / counts.sum()
    assert counts[2:].sum() == 0
    assert abs(freq[0].item() - 0.625) < 0.03


def test_draws_depend_only_on_the_sequence_seed():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    batch, _ = draw(logits, params, list(range(6)))
    alone = [draw(logits[i:i + 1], [params[i]], [i])[0][0] for i in range(6)]
    assert batch == alone
    # rows can be shared: two sequences drawing from one row with different seeds
    shared, _ = draw(logits, params[:2], [0, 1], rows=[3, 3])
    assert shared == [draw(logits[3:4], [params[0]], [0])[0][0], draw(logits[3:4], [params[1]], [1])[0][0]]
