"""mHC's projection fn @ rms_norm(x) with the backward that rebuilds the normed streams
(hyper_connection.NormedProjection): the eager ops' values and their autograd's gradients, while
keeping no fp32 copy of the streams (the saved-tensor count: tests/plan/test_plan_activations_measured.py)."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.layers import scaled_projection_triton as spt
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


@pytest.mark.parametrize("fn_dtype", [torch.float32, torch.bfloat16])  # fp32: as a bf16 model keeps it
def test_scaled_projection_is_the_normed_one_to_rounding(fn_dtype):
    """bf16 streams (a bf16 trainer): the norm's scale after the GEMM. Against the fp64 autograd
    of the eager ops on the same values: the forward to fp32 rounding, the gradients to the
    rounding of the dtype they come back in."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 7, 4, 32, generator=g) * 3).bfloat16().to(DEVICE).requires_grad_()
    fn = (torch.randn(24, 128, generator=g) * 0.05).to(fn_dtype).to(DEVICE).requires_grad_()
    w = torch.randn(3, 7, 24, generator=g).to(DEVICE)
    ours = _mixes(x, fn, 1e-6, triton=False)
    assert type(ours.grad_fn).__name__ == "ScaledProjectionBackward" and ours.dtype == torch.float32
    x64, fn64 = (t.detach().double().requires_grad_() for t in (x, fn))
    flat = x64.flatten(-2)
    ref = torch.nn.functional.linear(flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6), fn64)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    got = torch.autograd.grad((ours * w).sum(), (x, fn))
    want = torch.autograd.grad((ref * w.double()).sum(), (x64, fn64))
    for a, b, dtype in zip(got, want, (torch.bfloat16, fn_dtype)):
        assert a.dtype == dtype and a.shape == b.shape
        tol = 6e-3 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(a.double(), b, rtol=4 * tol, atol=tol * b.abs().max().item())


@pytest.mark.skipif(spt.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streams_gradient_kernel_equals_its_formula(dtype):
    """scaled_projection_triton.streams_grad (ScaledProjection's d x on a GPU): gr @ fn - s x against
    fp64, over rows and columns past one program's tile (32 x 128)."""
    g = torch.Generator().manual_seed(8)
    T, J, D = 70, 24, 300
    gr, fn, s = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((T, J), (J, D), (T, 1)))
    x = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    assert spt.applies(x, fn) == (DEVICE == "cuda" and dtype == torch.bfloat16)
    got = spt.streams_grad(gr, fn, s, x)
    want = gr.double() @ fn.double() - s.double() * x.double()
    assert got.dtype == dtype
    if dtype == torch.bfloat16:  # one rounding of the fp32 value
        torch.testing.assert_close(got, want.to(dtype), rtol=8e-3, atol=1e-5)
    else:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
