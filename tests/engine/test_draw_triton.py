"""The sampler's draw as Triton kernels (engine/draw_triton.py) against sampler.py's torch form:
torch.argmax's first maximum, the inverse CDF's token, log_softmax's logprob to fp32 rounding, and
where the sampler takes them. Under Triton's interpreter here (conftest.py); LOCKSTEP_TEST_DEVICE=cuda
runs them on a GPU."""

import pytest
import torch

from devices import DEVICE
from lockstep.config import SamplingParams
from lockstep.engine import draw_triton as dr
from lockstep.engine.sampler import DrawPlan, Sampler

pytestmark = pytest.mark.skipif(dr.triton is None, reason="Triton is not installed")
TOL = dict(rtol=1e-6, atol=2e-6)


def _torch_draw(x, T=1.0, u=None):
    """sampler.Sampler.draw's torch form (the kernels off) for one temperature, nothing truncated."""
    table = torch.zeros(x.shape[0], 5, dtype=torch.float64, device=x.device)
    table[:, 2] = -1.0 if u is None else u
    plan = DrawPlan(T, sampled=u is not None and bool((u >= 0).any()), truncated=False,
                    greedy=u is None or bool((u < 0).any()))
    return Sampler(draw_kernels=False).draw(x, table, plan, identity_rows=True)


def _logits(M, V, seed, scale=4.0):
    return (torch.randn(M, V, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


@pytest.mark.parametrize("V,block", [(1000, 0), (300, 64), (2001, 256)])
def test_a_greedy_token_and_logprob_are_torchs(V, block):
    """Ties inside a chunk and across chunks go to the first maximum; a row of -inf but one entry; the
    logprob to fp32 rounding (the chunks' sums combine in another order)."""
    x = _logits(6, V, V)
    x[0, 3] = x[0, V - 2] = 60.0  # a tie across chunks
    x[1, 40] = x[1, 41] = 60.0  # a tie within one
    x[2] = float("-inf")
    x[2, V // 2] = -3.0
    x[3, V - 1] = 60.0  # the last column (a partial chunk where V is not a multiple of block)
    tokens, logp = dr.draw(x, block=block)
    want_tokens, want_logp = _torch_draw(x)
    assert tokens.dtype == torch.int64 and logp.dtype == torch.float32
    assert torch.equal(tokens, want_tokens)
    assert tokens[:4].tolist() == [3, 40, V // 2, V - 1]
    torch.testing.assert_close(logp, want_logp, **TOL)


def test_a_nan_is_drawn_as_torch_draws_it():
    """NaN counts above every number: a row's first NaN is its token, its logprob NaN."""
    x = _logits(3, 500, 1)
    x[1, 300] = x[1, 40] = float("nan")
    tokens, logp = dr.draw(x, block=64)
    want_tokens, want_logp = _torch_draw(x)
    assert torch.equal(tokens, want_tokens) and tokens[1].item() == 40
    assert torch.isnan(logp[1]) and not torch.isnan(logp[[0, 2]]).any()
    torch.testing.assert_close(logp[[0, 2]], want_logp[[0, 2]], **TOL)


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_sampled_tokens_are_the_inverse_cdfs(T):
    """Rows sampled with their uniforms, greedy ones (u < 0) among them: the torch form's tokens (the
    masses summed in another order could differ only within fp64 rounding of a boundary) and logprobs;
    u near 0 and near 1 draw the first and the last token with mass."""
    M, V = 16, 600
    x = _logits(M, V, 5, scale=2.0)
    u = torch.rand(M, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    u[0], u[1], u[2] = 1e-12, 1 - 1e-12, -1.0
    table = torch.zeros(M, 5, dtype=torch.float64)
    table[:, 2] = u
    u = table[:, 2].to(DEVICE)  # a column of the sampler's table: strided
    tokens, logp = dr.draw(x, T, table.to(DEVICE)[:, 2], block=128)  # five chunks a row
    want_tokens, want_logp = _torch_draw(x, T, u)
    assert torch.equal(tokens, want_tokens)
    assert tokens[0].item() == 0 and tokens[1].item() == V - 1 and tokens[2].item() == x[2].argmax().item()
    torch.testing.assert_close(logp, want_logp, **TOL)
    assert len(set(tokens[3:].tolist())) > 8  # the draws spread over the vocabulary


def test_a_rows_bits_do_not_depend_on_the_batch():
    x = _logits(7, 1000, 2)
    u = torch.rand(7, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    u[1] = -1.0
    alone = dr.draw(x[4:5].clone(), 0.9, u[4:5].clone(), block=256)
    batched = dr.draw(x, 0.9, u, block=256)
    assert torch.equal(batched[0][4:5], alone[0]) and torch.equal(batched[1][4:5], alone[1])


def test_the_sampler_takes_the_kernels_for_one_temperature_untruncated(monkeypatch):
    """Greedy rows, or rows sampled at one temperature: the kernels, the torch form's tokens and
    logprobs; rows at two temperatures, a truncating row, or the switch off keep the torch form."""
    calls, kernel = [], dr.draw
    monkeypatch.setattr(dr, "draw", lambda x, T, u: calls.append((T, u is None)) or kernel(x, T, u))
    assert dr.runs(_logits(1, 9, 0), True) == (DEVICE == "cuda")  # on the CPU the torch form, unless told
    monkeypatch.setattr(dr, "runs", lambda x, enabled: enabled)
    x = _logits(4, 700, 3)
    rows, seeds, steps = [0, 1, 2, 3], [11, 12, 13, 14], [0, 5, 9, 2]
    for params in ([SamplingParams(temperature=0.0)] * 4, [SamplingParams(temperature=0.8, seed=1)] * 4):
        calls.clear()
        tokens, lps = Sampler(draw_kernels=True)(x, rows, params, seeds, steps)
        assert calls == [(params[0].temperature or 1.0, params[0].temperature == 0)]
        want = Sampler(draw_kernels=False)(x, rows, params, seeds, steps)
        assert len(calls) == 1 and tokens == want[0]
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want[1]), **TOL)
    for params in ([SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.8, seed=1)],
                   [SamplingParams(temperature=1.0, top_p=0.9, seed=1)] * 4):
        Sampler(draw_kernels=True)(x, rows, params, seeds, steps)
    assert len(calls) == 1
