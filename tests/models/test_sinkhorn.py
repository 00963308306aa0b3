"""mHC's Sinkhorn: the three ways it is computed agree (the plain loop is the definition)."""

import torch

from lockstep.models.layers.sinkhorn import sinkhorn, sinkhorn_reference, sinkhorn_unrolled


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


def test_unrolled_form_equals_the_loop():
    # the form torch.compile sees: element-wise ops, sums added in index order
    for dtype in (torch.float32, torch.float64):
        x = _comb(2, dtype)
        assert torch.allclose(sinkhorn_unrolled(x, 20, 1e-6), sinkhorn_reference(x, 20, 1e-6), rtol=0, atol=1e-6)
    x = _comb(3).requires_grad_()
    (g_unrolled,) = torch.autograd.grad(sinkhorn_unrolled(x, 20, 1e-6).sum(), x)
    (g_ref,) = torch.autograd.grad(sinkhorn_reference(x, 20, 1e-6).sum(), x)
    assert torch.allclose(g_unrolled, g_ref, rtol=1e-9, atol=1e-12)
