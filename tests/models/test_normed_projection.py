"""mHC's projection fn @ rms_norm(x) with the backward that rebuilds the normed streams
(hyper_connection.NormedProjection): the eager ops' values and their autograd's gradients, while
keeping no fp32 copy of the streams (the saved-tensor count: tests/plan/test_plan_activations_measured.py)."""

import pytest
import torch

from lockstep.models.layers.hyper_connection import NormedProjection, _mixes, _normed_projection


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_equal_and_gradients_agree_with_the_eager_autograd(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 2).to(dtype).requires_grad_()
    fn = torch.randn(24, 64, generator=g).requires_grad_()
    w = torch.randn(3, 5, 24, generator=g)
    eager, ours = _normed_projection(x, fn, 1e-6), NormedProjection.apply(x, fn, 1e-6)
    assert torch.equal(eager, ours)
    for a, b in zip(torch.autograd.grad((eager * w).sum(), (x, fn)), torch.autograd.grad((ours * w).sum(), (x, fn))):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b.float(), a.float(), rtol=1e-5, atol=1e-5 * a.float().abs().max().item())


def test_mixes_take_it_only_where_a_gradient_is_wanted():
    streams = torch.randn(2, 3, 4, 16).requires_grad_()
    fn = torch.randn(24, 64)
    assert type(_mixes(streams, fn, 1e-6, triton=False).grad_fn).__name__ == "NormedProjectionBackward"
    with torch.no_grad():
        assert _mixes(streams, fn, 1e-6, triton=False).grad_fn is None


def test_under_bf16_autocast_the_backward_runs():
    """`lockstep sft`'s bf16 autocast on the CPU: the forward's GEMM runs in bf16, so its gradient
    arrives in bf16; the parameters' gradients come back in their own dtypes, close to autocast's."""
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    fn = torch.randn(24, 64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    grads = []
    for project in (_normed_projection, NormedProjection.apply):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = project(x, fn, 1e-6)
        grads.append(torch.autograd.grad(out.float().square().sum(), (x, fn)))
    for ours, theirs in zip(grads[1], grads[0]):
        assert ours.dtype == theirs.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=3e-2, atol=3e-2 * theirs.abs().max().item())
