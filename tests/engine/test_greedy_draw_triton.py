"""The greedy draw's two Triton kernels (engine/greedy_draw_triton.py) against sampler.py's torch
form: torch.argmax's first maximum, log_softmax's logprob to fp32 rounding, and where the sampler
takes them. Under Triton's interpreter here (conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs them on a GPU."""

import pytest
import torch

from devices import DEVICE
from lockstep.config import SamplingParams
from lockstep.engine import greedy_draw_triton as gd
from lockstep.engine.sampler import Sampler

pytestmark = pytest.mark.skipif(gd.triton is None, reason="Triton is not installed")


def _torch_draw(x):
    tokens = x.argmax(dim=-1)
    return tokens, torch.log_softmax(x, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def _logits(M, V, seed):
    return (torch.randn(M, V, generator=torch.Generator().manual_seed(seed)) * 4).to(DEVICE)


@pytest.mark.parametrize("V,block", [(1000, 0), (300, 64), (5001, 256)])
def test_token_and_logprob_are_torchs(V, block):
    """Ties inside a chunk and across chunks go to the first maximum; a row of -inf but one entry; the
    logprob to fp32 rounding (the chunks' sums combine in another order)."""
    x = _logits(6, V, V)
    x[0, 3] = x[0, V - 2] = 60.0  # a tie across chunks
    x[1, 40] = x[1, 41] = 60.0  # a tie within one
    x[2] = float("-inf")
    x[2, V // 2] = -3.0
    x[3, V - 1] = 60.0  # the last column (a partial chunk where V is not a multiple of block)
    tokens, logp = gd.greedy_draw(x, block)
    want_tokens, want_logp = _torch_draw(x)
    assert tokens.dtype == torch.int64 and logp.dtype == torch.float32
    assert torch.equal(tokens, want_tokens)
    assert tokens[:4].tolist() == [3, 40, V // 2, V - 1]
    torch.testing.assert_close(logp, want_logp, rtol=1e-6, atol=2e-6)


def test_a_nan_is_drawn_as_torch_draws_it():
    """NaN counts above every number: a row's first NaN is its token, its logprob NaN."""
    x = _logits(3, 500, 1)
    x[1, 300] = x[1, 40] = float("nan")
    tokens, logp = gd.greedy_draw(x, 64)
    want_tokens, want_logp = _torch_draw(x)
    assert torch.equal(tokens, want_tokens) and tokens[1].item() == 40
    assert torch.isnan(logp[1]) and not torch.isnan(logp[[0, 2]]).any()
    torch.testing.assert_close(logp[[0, 2]], want_logp[[0, 2]], rtol=1e-6, atol=2e-6)


def test_a_rows_bits_do_not_depend_on_the_batch():
    x = _logits(7, 1000, 2)
    alone = gd.greedy_draw(x[4:5].clone(), 256)
    batched = gd.greedy_draw(x, 256)
    assert torch.equal(batched[0][4:5], alone[0]) and torch.equal(batched[1][4:5], alone[1])


def test_the_sampler_takes_the_kernels_for_greedy_rows_at_temperature_1(monkeypatch):
    """All rows greedy: the kernels, the torch form's tokens and logprobs; a sampled row, or the switch
    off, keeps the torch form."""
    calls, kernel = [], gd.greedy_draw
    monkeypatch.setattr(gd, "greedy_draw", lambda x: calls.append(x.shape) or kernel(x))
    assert gd.runs(_logits(1, 9, 0), True) == (DEVICE == "cuda")  # on the CPU the torch form, unless told
    monkeypatch.setattr(gd, "runs", lambda x, enabled: enabled)
    x = _logits(4, 700, 3)
    greedy = [SamplingParams(temperature=0.0)] * 4
    tokens, lps = Sampler(greedy_kernel=True)(x, [0, 1, 2, 3], greedy, [0] * 4, [0] * 4)
    assert calls == [(4, 700)]
    want_tokens, want_logp = _torch_draw(x.cpu())
    assert tokens == want_tokens.tolist()
    torch.testing.assert_close(torch.tensor(lps, dtype=torch.float32), want_logp, rtol=1e-6, atol=2e-6)
    assert Sampler(greedy_kernel=False)(x, [0, 1, 2, 3], greedy, [0] * 4, [0] * 4)[0] == tokens
    mixed = greedy[:3] + [SamplingParams(temperature=0.8, seed=1)]
    Sampler(greedy_kernel=True)(x, [0, 1, 2, 3], mixed, [0] * 4, [0] * 4)
    assert len(calls) == 1
