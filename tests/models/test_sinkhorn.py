"""mHC's Sinkhorn: the ways it is computed agree (the plain loop is the definition). The fused
Triton kernel runs under Triton's interpreter here (TRITON_INTERPRET=1, set in conftest.py); on
a GPU, LOCKSTEP_TEST_DEVICE=cuda runs its tests there."""

import os

import pytest
import torch

from lockstep.models.layers import sinkhorn_triton
from lockstep.models.layers.sinkhorn import (sinkhorn, sinkhorn_backward, sinkhorn_in_kernel_order,
                                             sinkhorn_reference)

needs_triton = pytest.mark.skipif(sinkhorn_triton.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"


def _comb(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(5, 3, 4, 4, generator=g, dtype=dtype) * 3, dim=-1) + 1e-6


def test_written_out_backward_equals_autograd_of_the_loop():
    x = _comb(0).requires_grad_()
    grad = torch.randn_like(x)
    ours = sinkhorn(x, 20, 1e-6)
    (g_ours,) = torch.autograd.grad(ours, x, grad)
    ref = sinkhorn_reference(x, 20, 1e-6)
    (g_ref,) = torch.autograd.grad(ref, x, grad)
    assert torch.equal(ours, ref)
    assert torch.allclose(g_ours, g_ref, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 3, 1e-6), (x[:2].detach().requires_grad_(),))


def test_columns_end_normalised_and_rows_converge():
    x = _comb(1, torch.float32)
    out = sinkhorn(x, 20, 1e-6)
    assert torch.allclose(out.sum(-2), torch.ones(5, 3, 4), atol=1e-5)  # the last step
    row_err = lambda t: (t.sum(-1) - 1).abs().max()  # noqa: E731
    assert row_err(out) < 0.1 * row_err(sinkhorn(x, 2, 1e-6))


@needs_triton
def test_fused_kernel_equals_the_loop():
    # 5 * 3 * 3 = 45 tokens: two programs of 32, the second one masked; a transposed (non-contiguous) input
    x = _comb(2, torch.float32).repeat(1, 3, 1, 1).transpose(-1, -2).to(DEVICE)
    assert sinkhorn_triton.available(x)
    out = sinkhorn_triton.sinkhorn_fused(x, 20, 1e-6)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.allclose(out, sinkhorn_reference(x, 20, 1e-6), rtol=0, atol=1e-6)


@needs_triton
def test_fused_kernel_gradient_equals_autograd_of_the_loop():
    x = _comb(3, torch.float32).to(DEVICE).requires_grad_()
    grad = torch.randn_like(x)
    (g_fused,) = torch.autograd.grad(sinkhorn_triton.sinkhorn_fused(x, 20, 1e-6), x, grad)
    (g_ref,) = torch.autograd.grad(sinkhorn_reference(x, 20, 1e-6), x, grad)
    assert torch.allclose(g_fused, g_ref, rtol=1e-4, atol=1e-5)  # fp32: gradients reach ~10 here
    assert torch.allclose(sinkhorn_backward(x.detach(), grad, 20, 1e-6), g_fused, rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("tokens,n,iters", [(33, 4, 20), (70, 4, 3), (19, 2, 7), (5, 8, 4), (9, 3, 1)])
def test_backward_kernel_is_the_written_out_gradient(tokens, n, iters):
    # against the fp64 gradient of the plain loop: the kernel's fp32 rounding is all that differs
    g = torch.Generator().manual_seed(tokens + n)
    x = torch.softmax(torch.randn(tokens, n, n, generator=g, dtype=torch.float64) * 3, dim=-1) + 1e-6
    grad = torch.randn(tokens, n, n, generator=g, dtype=torch.float64)
    ref = sinkhorn_backward(x, grad, iters, 1e-6)
    ours = sinkhorn_triton.sinkhorn_backward_fused(x.float().to(DEVICE), grad.float().to(DEVICE), iters, 1e-6)
    assert ours.shape == x.shape and ours.dtype == torch.float32
    assert torch.allclose(ours.cpu().double(), ref, rtol=1e-4, atol=1e-5)
    # a token's gradient is its own: alone, the same bits
    assert torch.equal(sinkhorn_triton.sinkhorn_backward_fused(x[-1:].float().to(DEVICE), grad[-1:].float().to(DEVICE),
                                                               iters, 1e-6), ours[-1:])


@needs_triton
@pytest.mark.parametrize("tokens", [1, 31, 33, 64, 100])  # one token; partial last program (BLOCK_T = 32)
def test_fused_kernel_is_the_loop_bit_for_bit(tokens):
    g = torch.Generator().manual_seed(tokens)
    x = (torch.softmax(torch.randn(tokens, 4, 4, generator=g) * 3, dim=-1) + 1e-6).to(DEVICE)
    out = sinkhorn_triton.sinkhorn_fused(x, 20, 1e-6)
    assert out.shape == x.shape
    assert torch.equal(out, sinkhorn_in_kernel_order(x, 20, 1e-6))
    assert torch.allclose(out, sinkhorn_reference(x, 20, 1e-6), rtol=0, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_fused_kernel_other_n(n):
    g = torch.Generator().manual_seed(n)
    x = (torch.softmax(torch.randn(2, 19, n, n, generator=g) * 3, dim=-1) + 1e-6).to(DEVICE)
    assert sinkhorn_triton.available(x)
    for iters in (1, 7):  # iters = 1: the column step alone
        out = sinkhorn_triton.sinkhorn_fused(x, iters, 1e-6)
        assert torch.equal(out, sinkhorn_in_kernel_order(x, iters, 1e-6))
        assert torch.allclose(out, sinkhorn_reference(x, iters, 1e-6), rtol=0, atol=1e-6)


def test_available_only_where_the_kernel_runs():
    if sinkhorn_triton.triton is None:
        assert not sinkhorn_triton.available(torch.ones(2, 4, 4))
        return
    assert sinkhorn_triton.available(torch.ones(2, 4, 4))
    assert not sinkhorn_triton.available(torch.ones(2, 4, 4, dtype=torch.float64))
    assert not sinkhorn_triton.available(torch.ones(2, sinkhorn_triton.MAX_N + 1, sinkhorn_triton.MAX_N + 1))
