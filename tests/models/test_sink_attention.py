"""The training forward's block-banded attention against the dense form it replaces: every query
scored against all S positions + the entries, the window a mask (sink_attention.py)."""

from __future__ import annotations

import pytest
import torch

from lockstep.models.layers import sink_attention as sink_attention_module
from lockstep.models.layers.sink_attention import (_dense_sink_attention, banded_sink_attention, sink_attention,
                                                   window_bias)


def dense(q, kv, window, sinks, scale, entries=None, entry_bias=None):
    pos = torch.arange(q.shape[1]).expand(q.shape[0], -1)
    keys, bias = kv, window_bias(pos, pos, torch.ones_like(pos, dtype=torch.bool), window)
    if entries is not None:
        keys, bias = torch.cat([kv, entries], dim=1), torch.cat([bias, entry_bias], dim=2)
    return sink_attention(q, keys, bias, sinks, scale)


def inputs(N, S, H, D, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(N, S, H, D, generator=g), torch.randn(N, S, D, generator=g)
    sinks = torch.randn(H, generator=g)
    entries = entry_bias = None
    if E:
        entries = torch.randn(N, E, D, generator=g)
        # a top-k style pick: some entries visible, some rows with none (the sink then takes the rest)
        seen = torch.rand(N, S, E, generator=g) < 0.4
        seen[:, : S // 3] = False
        entry_bias = torch.zeros(N, S, E).masked_fill(~seen, float("-inf"))
    return [t.requires_grad_() if t is not None and t.is_floating_point() and t is not entry_bias else t
            for t in (q, kv, sinks, entries)] + [entry_bias]


@pytest.mark.parametrize("S, window, E", [(40, 8, 0), (37, 8, 5), (70, 8, 9), (50, 1, 0), (6, 8, 3), (16, 16, 4)])
def test_banded_equals_dense_with_gradients(S, window, E):
    """Same output and gradients (fp32, to rounding: masked keys add exact zeros, only the sums'
    lengths differ) for S a multiple of the window or not, window 1; the last two, S at most the
    window, take the dense form itself."""
    q, kv, sinks, entries, entry_bias = inputs(2, S, 3, 8, E)
    outs, grads = [], []
    for fn in (dense, banded_sink_attention):
        out = fn(q, kv, window, sinks, 0.3, entries, entry_bias)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        leaves = [t for t in (q, kv, sinks, entries) if t is not None]
        outs.append(out)
        grads.append(torch.autograd.grad((out * w).sum(), leaves))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for b, d in zip(*grads):
        torch.testing.assert_close(b, d, rtol=1e-5, atol=1e-5)


def test_a_key_outside_the_window_does_not_reach_the_query():
    """Changing position 0's key moves queries 0..window-1 only; the band must not leak it further."""
    q, kv, sinks, _, _ = inputs(1, 24, 2, 4, 0)
    with torch.no_grad():
        a = banded_sink_attention(q, kv, 8, sinks, 0.5)
        kv2 = kv.clone()
        kv2[:, 0] += 3.0
        b = banded_sink_attention(q, kv2, 8, sinks, 0.5)
    moved = (a != b).flatten(2).any(-1)[0]
    assert moved[:8].all() and not moved[8:].any()


@pytest.mark.parametrize("S, window, dense", [(6, 8, True), (16, 16, True), (19, 8, True), (20, 8, False), (40, 8, False)])
def test_short_sequences_take_the_dense_form(S, window, dense, monkeypatch):
    """Blocks of W rows score 2W keys a row: below S ~ 2.4 W that is more than the dense S."""
    taken = []

    def spy(*args):
        taken.append(S)
        return _dense_sink_attention(*args)

    monkeypatch.setattr(sink_attention_module, "_dense_sink_attention", spy)
    q, kv, sinks, _, _ = inputs(1, S, 2, 4, 0)
    with torch.no_grad():
        banded_sink_attention(q, kv, window, sinks, 0.5)
    assert bool(taken) == dense
