"""The trainer's clamped SwiGLU kernels (models/layers/swiglu_triton.py) against moe.swiglu_clamped:
bf16 forward bits, gradients against fp64 autograd; under Triton's interpreter here
(TRITON_INTERPRET=1, conftest.py), compiled on a GPU with LOCKSTEP_TEST_DEVICE=cuda."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.layers import swiglu_triton
from lockstep.models.layers.moe import swiglu_clamped

pytestmark = pytest.mark.skipif(swiglu_triton.triton is None, reason="Triton is not installed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_values_and_gradients(dtype):
    g = torch.Generator().manual_seed(1)
    N, F, limit = 7, 1100, 2.5  # F over one program's 1024 columns; values past the limit both ways
    h = (torch.randn(N, 2 * F, generator=g) * 3).to(DEVICE, dtype).requires_grad_()
    w = torch.randn(N, F, generator=g).to(DEVICE, dtype)
    got = swiglu_triton.SwigluClamped.apply(h, limit)
    want = swiglu_clamped(*h.chunk(2, dim=-1), limit)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # the eager ops' roundings
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (d_h,) = torch.autograd.grad((got * w).sum(), h)
    h64 = h.detach().double().requires_grad_()
    (want64,) = torch.autograd.grad((swiglu_clamped(*h64.chunk(2, dim=-1), limit) * w.double()).sum(), h64)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_h.double(), want64, **tol)
    assert (d_h[:, :F][h.detach()[:, :F] > limit] == 0).all()  # clamped: no gradient
    assert not swiglu_triton.applies(h.detach())  # no gradient wanted: the eager ops
