"""The trainer's flash-style attention kernels (models/layers/flash_sink_attention_triton.py), forward
and backward, against the torch form they replace (sink_attention.banded_sink_attention) computed
in fp64: under Triton's interpreter here (TRITON_INTERPRET=1, conftest.py), compiled on a GPU with
LOCKSTEP_TEST_DEVICE=cuda."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.layers import flash_sink_attention_triton as flash
from lockstep.models.layers.sink_attention import banded_sink_attention, closed_block_bias

pytestmark = pytest.mark.skipif(flash.triton is None, reason="Triton is not installed")


def _inputs(dtype, N=2, S=37, H=3, D=16, E=5, topk=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, S, H, D, generator=g)
    kv = torch.randn(N, S, D, generator=g)
    sinks = torch.randn(H, generator=g)
    entries = torch.randn(N, E, D, generator=g) if E else None
    bias = None
    if E:
        pos = torch.arange(S).expand(N, S)
        bias = closed_block_bias(pos, E, 4)  # entry j seen once its block of 4 closed
        if topk:  # the indexer's picks: a random subset of the closed entries
            bias = bias.masked_fill(torch.rand(N, S, E, generator=g) < 0.4, float("-inf"))
    to = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return to(q), to(kv), sinks.to(DEVICE), to(entries), None if bias is None else bias.to(DEVICE)


def _grads(fn, q, kv, sinks, entries, bias, w, window, scale):
    leaves = [t.detach().requires_grad_() for t in (q, kv, sinks)] + (
        [entries.detach().requires_grad_()] if entries is not None else [])
    out = fn(leaves[0], leaves[1], window, leaves[2], scale, leaves[3] if entries is not None else None, bias)
    return out, torch.autograd.grad((out.to(w.dtype) * w).sum(), leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["window", "closed-blocks", "top-k"])
def test_forward_and_gradients_equal_the_torch_form(dtype, case):
    """Values and the gradients of q, kv, the sinks and the entries, against the torch form in fp64:
    fp32 to fp32 rounding, bf16 to the rounding of bf16 scores and probabilities."""
    E = 0 if case == "window" else 5
    q, kv, sinks, entries, bias = _inputs(dtype, E=E, topk=case == "top-k")
    window, scale = 8, 0.3
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.float64)
    got, got_grads = _grads(flash.flash_banded_sink_attention, q, kv, sinks, entries, bias, w, window, scale)
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    want, want_grads = _grads(banded_sink_attention, f64(q), f64(kv), f64(sinks), f64(entries), f64(bias), w,
                              window, scale)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    for name, a, b in zip(("q", "kv", "sinks", "entries"), got_grads, want_grads):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * b.abs().max().item(), msg=name)


def test_rows_past_a_program_and_tiles_past_the_keys():
    """More positions than one program's rows and one tile's keys (S * H = 3 * 80 rows, 16-key tiles
    set below): every row and key tile boundary is crossed, in the forward and both backward kernels."""
    q, kv, sinks, entries, bias = _inputs(torch.float32, N=1, S=80, H=3, E=20, topk=True, seed=4)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float64)
    old = flash.BLOCK_M, flash.BLOCK_N, flash.SPLIT
    flash.BLOCK_M, flash.BLOCK_N, flash.SPLIT = 16, 16, 3
    try:
        got, got_grads = _grads(flash.flash_banded_sink_attention, q, kv, sinks, entries, bias, w, 24, 0.25)
    finally:
        flash.BLOCK_M, flash.BLOCK_N, flash.SPLIT = old
    want, want_grads = _grads(banded_sink_attention, q.double(), kv.double(), sinks.double(), entries.double(),
                              bias.double(), w, 24, 0.25)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_the_trainer_takes_it_only_where_it_should():
    x = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    kv = torch.randn(1, 4, 16, dtype=torch.bfloat16)
    assert not flash.runs(x, kv, enabled=True)  # the CPU: the torch form
    if torch.cuda.is_available():
        xc, kvc = x.cuda().requires_grad_(), kv.cuda()
        assert flash.runs(xc, kvc, enabled=True) and not flash.runs(xc, kvc, enabled=False)
        with torch.no_grad():
            assert not flash.runs(xc, kvc, enabled=True)  # no gradient wanted: the engine's prefill
