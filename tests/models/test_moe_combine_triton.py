"""The trainer's MoE combine kernels (models/layers/moe_combine_triton.py) against moe._combine of
the unsorted outputs: the forward's bits and d ys's bits, d w to fp32 rounding; the dispatch's
gradient against the fp64 sum; under Triton's
interpreter here (TRITON_INTERPRET=1, conftest.py), compiled on a GPU with LOCKSTEP_TEST_DEVICE=cuda."""

import pytest
import torch

from devices import DEVICE, KERNEL_DTYPES
from lockstep.models.deepseek_v4_init import tiny_config
from lockstep.models.layers import moe_combine_triton
from lockstep.models.layers.moe import _combine, dispatch_order
from switched_training import assert_switch_changes_nothing
from compiled_op import compile_op

pytestmark = pytest.mark.skipif(moe_combine_triton.triton is None, reason="Triton is not installed")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("H", [40, 1100])  # one column tile, and two with a partial one (tiles of 1024)
def test_the_eager_combines_bits_and_gradients(dtype, H):
    g = torch.Generator().manual_seed(H)
    T, k, E = 9, 3, 5
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    order, _ = dispatch_order(experts.flatten(), E, counting=False)
    ys = (torch.randn(T * k, H, generator=g) * 3).to(DEVICE, dtype).requires_grad_()
    weights = torch.rand(T, k, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    got = moe_combine_triton.combine(ys, order, weights)
    want = _combine(torch.empty_like(ys).index_copy(0, order, ys).view(T, k, -1), weights, dtype)
    # bf16 rounds each product before the add; unrounded fp32 ones a GPU compiler may fuse into an FMA
    same = torch.equal if dtype == torch.bfloat16 or DEVICE == "cpu" else torch.allclose
    assert got.dtype == dtype and same(got, want)
    got_grads = torch.autograd.grad((got * w).sum(), (ys, weights))
    want_grads = torch.autograd.grad((want * w).sum(), (ys, weights))
    assert torch.equal(got_grads[0], want_grads[0])
    torch.testing.assert_close(got_grads[1], want_grads[1], rtol=1e-5, atol=1e-5 * want_grads[1].abs().max().item())


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("H", [40, 1100])
@pytest.mark.parametrize("shared", [False, True])
def test_the_decode_steps_combine_is_the_torch_ops(dtype, H, shared):
    """combine_step (a decode step's, compiled): moe._combine of the unsorted outputs, then the shared
    expert's rows (ys's rows past T k) added, as Experts._with_shared adds them, bit for bit."""
    g = torch.Generator().manual_seed(H + 2)
    T, k, E = 9, 3, 5
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    order, _ = dispatch_order(experts.flatten(), E, counting=False)
    ys = (torch.randn(T * k + T * shared, H, generator=g) * 3).to(DEVICE, dtype)
    weights = torch.rand(T, k, generator=g).to(DEVICE)
    rows = moe_combine_triton.slot_rows(order, T, k)
    want = _combine(torch.empty_like(ys[:T * k]).index_copy(0, order, ys[:T * k]).view(T, k, -1), weights, dtype)
    if shared:
        want = want + ys[T * k:]
    same = torch.equal if dtype == torch.bfloat16 or DEVICE == "cpu" else torch.allclose  # as above
    got = moe_combine_triton.combine_step(ys, rows, weights, shared)
    assert got.dtype == dtype and same(got, want)
    compiled = compile_op(moe_combine_triton.combine_step)
    assert torch.equal(compiled(ys, rows, weights, shared), got)


@pytest.mark.parametrize("H", [40, 1100])
def test_the_decode_steps_combine_can_do_the_mhc_combine(H):
    """combine_step with the block's streams: X'_k = post_k y + sum_j comb[j, k] X_j of its result y,
    the coefficients rounded to bf16, the sum over j in fp32 in order, rounded once, then the
    product and the add as bf16 ops: that, bit for bit (an fma on a GPU may round once where this
    rounds twice: there to a bf16 ulp), and hyper_connection.hc_combine to a bf16 ulp."""
    from lockstep.models.layers.hyper_connection import hc_combine

    g = torch.Generator().manual_seed(H + 3)
    T, k, E, n = 9, 3, 5, 4
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    order, _ = dispatch_order(experts.flatten(), E, counting=False)
    ys = torch.randn(T * k + T, H, generator=g).to(DEVICE, torch.bfloat16)
    weights = torch.rand(T, k, generator=g).to(DEVICE)
    rows = moe_combine_triton.slot_rows(order, T, k)
    streams = torch.randn(T, n, H, generator=g).to(DEVICE, torch.bfloat16)
    post = (torch.rand(T, n, generator=g) * 2).to(DEVICE)
    comb = torch.rand(T, n, n, generator=g).to(DEVICE)
    y = moe_combine_triton.combine_step(ys, rows, weights, True)
    got = moe_combine_triton.combine_step(ys, rows, weights, True, streams, post, comb)
    c, x = comb.bfloat16().float(), streams.float()
    mixed = torch.zeros(T, n, H, device=DEVICE)
    for j in range(n):
        mixed = mixed + c[:, j, :, None] * x[:, j, None, :]
    want = (post.bfloat16()[..., None] * y[:, None, :]).float() + mixed.bfloat16().float()
    assert got.shape == streams.shape and got.dtype == torch.bfloat16
    tol = 2**-7 * want.abs().max().item()
    if DEVICE == "cpu":
        assert torch.equal(got, want.bfloat16())
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=2**-7, atol=tol)
    ref = hc_combine(streams, y, post, comb)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-6, atol=2 * tol)
    compiled = compile_op(moe_combine_triton.combine_step)
    assert torch.equal(compiled(ys, rows, weights, True, streams, post, comb), got)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("H", [40, 1100])
def test_the_dispatch_gradient_adds_a_tokens_rows_once_rounded(dtype, H):
    """Dispatch: forward x[order // k]; d x[t] = the sum of its k rows' gradients, the fp32 sum rounded
    once (against fp64: within half a unit in the last place of x's dtype, where the eager index_put may
    round each add) and the eager gradient within those roundings."""
    g = torch.Generator().manual_seed(H + 1)
    T, k, E = 9, 3, 5
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    order, _ = dispatch_order(experts.flatten(), E, counting=False)
    x = (torch.randn(T, H, generator=g) * 3).to(DEVICE, dtype).requires_grad_()
    w = torch.randn(T * k, H, generator=g).to(DEVICE, dtype)
    xs = moe_combine_triton.dispatch(x, order, k)
    assert torch.equal(xs, x[order // k])
    (got,) = torch.autograd.grad(xs, x, w)
    (eager,) = torch.autograd.grad(x[order // k], x, w)
    exact = torch.zeros(T, H, dtype=torch.float64, device=DEVICE).index_add_(0, order // k, w.double())
    assert got.dtype == dtype
    # one rounding to x's dtype (at most eps |value| / 2) after k fp32 adds (each within 2^-24 of the running sum)
    magnitude = torch.zeros_like(exact).index_add_(0, order // k, w.double().abs())
    bound = torch.finfo(dtype).eps / 2 * exact.abs() + k * 2.0 ** -24 * magnitude
    assert ((got.double() - exact).abs() <= bound).all()
    # the eager gradient may round each add: within k roundings of it
    assert ((got.double() - eager.double()).abs() <= k * torch.finfo(dtype).eps * magnitude).all()


def test_a_model_with_the_switch_on_trains_as_with_the_eager_ops(monkeypatch):
    """Whole DeepSeek-V4 model (fp32 here, bf16 on a GPU): loss and gradients as with the eager ops, every routed MoE
    layer (top-k and hash) through the kernels, the dispatch and the combine."""
    calls = []
    for fn in (moe_combine_triton.Combine, moe_combine_triton.Dispatch):
        monkeypatch.setattr(fn, "apply", lambda *a, apply=fn.apply: calls.append(1) or apply(*a))
    assert_switch_changes_nothing("triton_combine", seed=9, shape=(1, 24))
    assert len(calls) == 2 * tiny_config().num_hidden_layers
