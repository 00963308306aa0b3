"""mHC's per-token stream mix (stream_mix_triton.py): the Triton kernel against its PyTorch
reference (the same bits: bf16 products, fp32 sums in stream order, one rounding) and the batched
GEMM it replaces (to rounding), and StreamMix's gradients against the GEMM's autograd. Under
Triton's interpreter here (TRITON_INTERPRET=1, conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs it on a GPU."""

import os

import pytest
import torch

from lockstep.models.layers import stream_mix_triton as sm

needs_triton = pytest.mark.skipif(sm.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE", "cpu").startswith("cuda") else "cpu"


def _operands(T=5, n=4, D=1100, dtype=torch.bfloat16, seed=0):
    # D over one program's 1024 elements: a partial second block
    g = torch.Generator().manual_seed(seed)
    comb = torch.rand(T, n, n, generator=g).to(dtype).to(DEVICE)
    streams = (torch.randn(T, n, D, generator=g) * 3).to(dtype).to(DEVICE)
    return comb, streams


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_its_reference_and_the_gemm(dtype):
    comb, streams = _operands(dtype=dtype)
    out = sm.stream_mix_op(comb, streams)
    assert out.dtype == dtype and out.shape == streams.shape
    if dtype == torch.bfloat16:  # fp32 products are not exact: a GPU's fused multiply-add rounds once less
        assert torch.equal(out, sm.stream_mix_reference(comb, streams))
    gemm = torch.matmul(comb.float().transpose(-1, -2), streams.float())
    torch.testing.assert_close(out.float(), gemm, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-5)


@needs_triton
def test_a_token_alone_gets_the_same_bits():
    comb, streams = _operands(T=9)
    assert torch.equal(sm.stream_mix_op(comb[3:4], streams[3:4]), sm.stream_mix_op(comb, streams)[3:4])


@needs_triton
def test_gradients_match_the_gemm_autograd():
    comb, streams = _operands(T=6, D=64, dtype=torch.float32)
    w = torch.randn(streams.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = []
    for mix in (lambda c, x: torch.matmul(c.transpose(-1, -2), x), sm.StreamMix.apply):
        c, x = comb.clone().requires_grad_(), streams.clone().requires_grad_()
        (mix(c, x) * w).sum().backward()
        grads.append((c.grad, x.grad))
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_without_triton_the_reference_runs(monkeypatch):
    monkeypatch.setattr(sm, "triton", None)
    comb, streams = _operands(T=2, D=8)
    assert torch.equal(sm.stream_mix(comb, streams), sm.stream_mix_reference(comb, streams))


def test_hc_combine_takes_the_same_sums_as_the_gemm():
    """On CUDA (bf16) hc_combine's eager path runs the kernel; elsewhere the GEMM: either way the
    mix of a bf16 GEMM (to the GEMM's own rounding)."""
    from lockstep.models.layers.hyper_connection import hc_combine

    comb, streams = _operands(T=6, D=256)
    g = torch.Generator().manual_seed(2)
    block_out = torch.randn(6, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    post = torch.rand(6, 4, generator=g).to(DEVICE)
    out = hc_combine(streams.view(2, 3, 4, 256), block_out.view(2, 3, 256), post.view(2, 3, 4), comb.view(2, 3, 4, 4))
    gemm = torch.matmul(comb.transpose(-1, -2), streams)
    ref = post.to(torch.bfloat16).unsqueeze(-1) * block_out.unsqueeze(-2) + gemm
    torch.testing.assert_close(out.view_as(ref).float(), ref.float(), rtol=2e-2, atol=2e-2)
