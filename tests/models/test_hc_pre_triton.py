"""mHC's pre stage at a decode step as two kernels (hyper_connection.pre_step: the projection's
partials, then hc_pre_triton.py's mixes, coefficients, Sinkhorn and collapse) against the torch
chain it replaces (_mixes, _coefficients, _collapse) and fp64. The kernels run under Triton's
interpreter here (TRITON_INTERPRET=1, set in conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs the same
tests on a GPU."""

import copy
import os

import pytest
import torch

from lockstep.models.layers import hc_pre_triton as hp
from lockstep.models.layers import hyper_connection, sinkhorn_triton
from lockstep.models.layers.hyper_connection import HyperConnection, _coefficients, _collapse, _mixes, pre_step
from lockstep.models.layers.kernel_switch import KernelSwitches
from lockstep.models.layers.norm import RMSNorm

needs_triton = pytest.mark.skipif(hp.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6


def _block(n, D, seed):
    """A HyperConnection with weights of the trained model's scale (fn ~ 1 / sqrt(n D), bases and
    scales of order one, so the softmax and sigmoids are not saturated)."""
    g = torch.Generator().manual_seed(seed)
    hc = HyperConnection(n, D, ITERS, HC_EPS, NORM_EPS)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * (n * D) ** -0.5)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
    return hc.to(DEVICE)


def _streams(T, n, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, 1, n, D, generator=g) * 3).to(dtype).to(DEVICE)


def _torch_chain(hc, streams, double=False):
    if double:
        hc, streams = copy.deepcopy(hc).double(), streams.double()
    mixes = _mixes(streams, hc.fn, NORM_EPS, False)
    pre, post, comb = _coefficients(mixes, hc.base, hc.scale, hc.hc_mult, ITERS, HC_EPS)
    return _collapse(pre, streams), post, comb


def _pre_step(hc, streams):
    return pre_step(streams, hc.fn, hc.base, hc.scale, ITERS, HC_EPS, NORM_EPS)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# the 1b config's mHC (n = 4, D = 1024: 32 splits of K); a D not a multiple of the kernel's block,
# a token count not a power of two; n = 2; n = 3 (its tiles padded to 4)
@pytest.mark.parametrize("T,n,D", [(5, 4, 1024), (3, 4, 200), (2, 2, 96), (2, 3, 64)])
def test_the_kernels_equal_the_torch_chain(dtype, T, n, D):
    hc, streams = _block(n, D, T + D), _streams(T, n, D, dtype, n * D)
    with torch.no_grad():
        x_in, post, comb = _pre_step(hc, streams)
        ref_x, ref_post, ref_comb = _torch_chain(hc, streams)
        exact_x = _torch_chain(hc, streams, double=True)[0]  # its coefficients are fp32 still
    assert x_in.shape == (T, 1, D) and x_in.dtype == dtype
    assert post.shape == (T, 1, n) and comb.shape == (T, 1, n, n) and post.dtype == comb.dtype == torch.float32
    # fp32 coefficients summed in another order (the splits in a tree)
    torch.testing.assert_close(post, ref_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-6)
    # doubly stochastic up to eps
    torch.testing.assert_close(comb.sum(-1), torch.ones_like(comb.sum(-1)), rtol=0, atol=1e-4)
    if dtype == torch.float32:
        torch.testing.assert_close(x_in, ref_x, rtol=1e-5, atol=1e-5)
    else:  # rounded once, as the torch chain: within a bf16 ulp of it, and as close to fp64
        torch.testing.assert_close(x_in.float(), ref_x.float(), rtol=2 ** -7, atol=2 ** -9)
        assert (x_in.double() - exact_x).abs().max() <= 1.5 * (ref_x.double() - exact_x).abs().max()


@needs_triton
@pytest.mark.parametrize("T,D", [(5, 1024), (3, 200)])
def test_the_kernel_can_apply_the_blocks_norm(T, D):
    """With the block's RMSNorm passed (bf16 streams), the block input comes out normed: the
    unnormed kernel's output through RMSNorm, to a bf16 ulp of the row's largest (the sum of squares
    in another order); the coefficients as without it."""
    hc, streams = _block(4, D, T), _streams(T, 4, D, torch.bfloat16, D)
    norm = RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=torch.Generator().manual_seed(2)) + 0.5)
    norm = norm.to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        x_in, post, comb = _pre_step(hc, streams)
        normed, post_n, comb_n = pre_step(streams, hc.fn, hc.base, hc.scale, ITERS, HC_EPS, NORM_EPS, norm)
        want = norm(x_in)
    assert torch.equal(post_n, post) and torch.equal(comb_n, comb)
    assert normed.shape == want.shape and normed.dtype == torch.bfloat16
    diff = (normed.float() - want.float()).abs()
    assert (diff <= 2 ** -7 * want.float().abs().amax(-1, keepdim=True)).all()
    assert (diff == 0).float().mean() > 0.98


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_block_passes_its_norm_to_the_kernel_for_bf16_streams(monkeypatch, dtype):
    """HyperConnection.forward(streams, norm) on the kernel path: bf16 streams hand the norm to the
    kernel, other dtypes get it applied after (the kernel's norm rounds to bf16)."""
    monkeypatch.setattr(hyper_connection, "_triton_mixes", lambda *a: True)  # the decode path, on this CPU
    seen = []
    monkeypatch.setattr(hyper_connection, "pre_step", lambda *a: seen.append(a[-1]) or pre_step(*a))
    hc, streams = _block(4, 128, 3), _streams(3, 4, 128, dtype, 4)
    norm = RMSNorm(128).to(DEVICE, dtype)
    with torch.no_grad():
        normed, _, _ = hc(streams, norm)
        want = norm(hc(streams)[0])
    assert seen[0] is (norm if dtype == torch.bfloat16 else None) and seen[1] is None
    torch.testing.assert_close(normed.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    assert dtype == torch.bfloat16 or torch.equal(normed, want)


@needs_triton
def test_the_sinkhorn_agrees_with_the_fused_sinkhorn_kernel():
    # the coefficients' softmax in torch, then the fused Sinkhorn kernel, against this kernel's comb:
    # the same steps and division, sums in another order and the mixes' roundings between them
    hc, streams = _block(4, 256, 3), _streams(4, 4, 256, torch.float32, 4)
    with torch.no_grad():
        _, _, comb = _pre_step(hc, streams)
        mixes = _mixes(streams, hc.fn, NORM_EPS, False)
        m_comb = mixes[..., 8:].unflatten(-1, (4, 4)) * hc.scale[2] + hc.base[8:].view(4, 4)
        ref = sinkhorn_triton.sinkhorn_fused(torch.softmax(m_comb, -1) + HC_EPS, ITERS, HC_EPS)
    torch.testing.assert_close(comb, ref, rtol=1e-5, atol=1e-7)


@needs_triton
def test_a_tokens_results_do_not_depend_on_the_batch():
    hc, streams = _block(4, 512, 9), _streams(6, 4, 512, torch.bfloat16, 10)
    with torch.no_grad():
        whole = _pre_step(hc, streams)
        alone = _pre_step(hc, streams[2:3].clone())
    for a, b in zip(whole, alone):
        assert torch.equal(a[2:3], b)


def test_the_block_takes_the_kernels_only_at_a_decode_step_on_cuda(monkeypatch):
    hc = HyperConnection(4, 64, ITERS, HC_EPS, NORM_EPS)
    torch.nn.init.normal_(hc.fn, std=0.02)  # allocated uninitialised: NaNs would make every comparison fail
    hc.kernels = KernelSwitches()
    seen = []
    monkeypatch.setattr(hyper_connection, "pre_step", lambda *a: seen.append(a) or pre_step(*a))
    streams = torch.randn(2, 1, 4, 64)
    norm = RMSNorm(64)
    with torch.no_grad():
        hc(streams)  # CPU: the torch chain
        collapsed, post, comb = hc(streams)
        normed, post_n, comb_n = hc(streams, norm)  # the block's norm after it
    assert seen == []
    assert torch.equal(normed, norm(collapsed)) and torch.equal(post_n, post) and torch.equal(comb_n, comb)
    if torch.cuda.is_available():
        hc.cuda()
        with torch.no_grad():
            hc(streams.cuda())
            hc(streams.cuda().expand(2, 3, 4, 64))  # prefill: several positions, the torch chain
        assert len(seen) == 1
        hc(streams.cuda())  # gradients wanted (the trainer's forward): the torch chain
        assert len(seen) == 1


@needs_triton
def test_compiled_callers_get_the_kernels_result():
    hc, streams = _block(4, 128, 5), _streams(2, 4, 128, torch.bfloat16, 6)
    compiled = torch.compile(_pre_step, backend="eager", fullgraph=True)
    with torch.no_grad():
        for a, b in zip(compiled(hc, streams), _pre_step(hc, streams)):
            assert torch.equal(a, b)
