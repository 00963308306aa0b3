"""The trainer's flash-style attention kernels (models/layers/flash_sink_attention_triton.py), forward
and backward, against the torch form they replace (sink_attention.banded_sink_attention) computed
in fp64: under Triton's interpreter here (TRITON_INTERPRET=1, conftest.py), compiled on a GPU with
LOCKSTEP_TEST_DEVICE=cuda."""

import pytest
import torch

from devices import DEVICE, KERNEL_DTYPES
from lockstep.models.layers import flash_sink_attention_triton as flash
from lockstep.models.layers.sink_attention import banded_sink_attention, closed_block_bias
from switched_training import assert_switch_changes_nothing

pytestmark = pytest.mark.skipif(flash.triton is None, reason="Triton is not installed")


def _inputs(dtype, N=2, S=37, H=3, D=16, E=5, topk=False, seed=0):
    """q, kv, sinks, entries, entry_bias: the entries close every 4 positions (closed_block_bias);
    topk: the indexer's picks, a random subset of the closed ones."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, S, H, D, generator=g)
    kv = torch.randn(N, S, D, generator=g)
    sinks = torch.randn(H, generator=g)
    entries = torch.randn(N, E, D, generator=g) if E else None
    bias = None
    if E:
        pos = torch.arange(S).expand(N, S)
        bias = closed_block_bias(pos, E, 4)
        if topk:
            bias = bias.masked_fill(torch.rand(N, S, E, generator=g) < 0.4, float("-inf"))
    to = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return to(q), to(kv), sinks.to(DEVICE), to(entries), None if bias is None else bias.to(DEVICE)


def _grads(fn, q, kv, sinks, entries, bias, w, window, scale, *rate):
    leaves = [t.detach().requires_grad_() for t in (q, kv, sinks)] + (
        [entries.detach().requires_grad_()] if entries is not None else [])
    out = fn(leaves[0], leaves[1], window, leaves[2], scale, leaves[3] if entries is not None else None, bias, *rate)
    return out, torch.autograd.grad((out.to(w.dtype) * w).sum(), leaves)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", ["window", "closed-blocks", "top-k", "top-k, every entry tile"])
def test_forward_and_gradients_equal_the_torch_form(dtype, case):
    """Values and the gradients of q, kv, the sinks and the entries, against the torch form in fp64:
    fp32 to fp32 rounding, bf16 to the rounding of bf16 scores and probabilities. The entries close
    every 4 positions; the kernels skip those not closed yet, or (compress_rate None) score them all."""
    E = 0 if case == "window" else 5
    q, kv, sinks, entries, bias = _inputs(dtype, E=E, topk=case.startswith("top-k"))
    window, scale, rate = 8, 0.3, None if case.endswith("every entry tile") else 4
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.float64)
    got, got_grads = _grads(flash.flash_banded_sink_attention, q, kv, sinks, entries, bias, w, window, scale, rate)
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
    """More positions than one program's rows and one tile's keys (S * H = 80 * 4 rows, 16-row programs
    and 16-key tiles set below): every row and key tile boundary is crossed, in the forward and both
    backward kernels; the program of positions 64..67 sees entry 16 (closed at 67), the first of a tile."""
    dtype = KERNEL_DTYPES[0]
    q, kv, sinks, entries, bias = _inputs(dtype, N=1, S=80, H=4, E=20, topk=False, seed=4)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float64)
    old = flash.BLOCK_M, flash.BLOCK_N, flash.SPLIT
    flash.BLOCK_M, flash.BLOCK_N, flash.SPLIT = 16, 16, 3
    try:
        got, got_grads = _grads(flash.flash_banded_sink_attention, q, kv, sinks, entries, bias, w, 24, 0.25, 4)
    finally:
        flash.BLOCK_M, flash.BLOCK_N, flash.SPLIT = old
    want, want_grads = _grads(banded_sink_attention, q.double(), kv.double(), sinks.double(), entries.double(),
                              bias.double(), w, 24, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_the_backward_row_dots_equal_the_fp64_sums(dtype):
    """delta = rowsum(dO * O) in one pass (`row_dots`): rows past a program's 32 and a row length
    off a power of two; the products of bf16 values are exact in fp32, the sums to fp32 rounding."""
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randn(3, 23, 48, generator=g).to(DEVICE, dtype) for _ in range(2))
    got = flash.row_dots(a, b)
    want = (a.double() * b.double()).sum(-1)
    assert got.dtype == torch.float32 and got.shape == (3, 23)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert flash.row_dots(a[:0], b[:0]).shape == (0, 23)


def test_the_trainer_takes_it_only_where_it_should():
    x = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.randn(1, 4, 16, dtype=torch.bfloat16, device=DEVICE)
    assert flash.runs(x, kv, enabled=True) and not flash.runs(x, kv, enabled=False)
    assert flash.runs(x, kv, enabled=None) == (DEVICE == "cuda")  # the default: CUDA only, not the interpreter
    with torch.no_grad():
        assert not flash.runs(x, kv, enabled=True)  # no gradient wanted: the engine's prefill
    assert not flash.runs(x[..., :8], kv[..., :8], enabled=True)  # head dim below tl.dot's 16
    assert flash.runs(x.float(), kv.float(), enabled=True) == (DEVICE == "cpu")  # fp32: the interpreter only


def test_a_model_with_the_switch_on_trains_as_with_the_torch_form(monkeypatch):
    """Whole DeepSeek-V4 model (window, C4 top-k and C128 layers; fp32 here, bf16 on a GPU): the loss
    and every parameter's gradient with the kernels equal the torch form's to the dtype's rounding."""
    calls = []
    forward = flash._forward
    monkeypatch.setattr(flash, "_forward", lambda *a: calls.append(a[3] is not None) or forward(*a))
    grads = assert_switch_changes_nothing("flash_attention", seed=3, shape=(2, 40))
    assert calls == [False, True, True, True]  # switched on only, every layer: window, C4, C128, C4
    assert any("sinks" in k for k in grads)
