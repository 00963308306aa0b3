"""mHC's projection with its RMSNorm as a Triton kernel (hc_projection_triton.py) against the
definition, F.linear(rms_norm(x.float()), fn). The kernel runs under Triton's interpreter here
(TRITON_INTERPRET=1, set in conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs the same tests on a GPU."""

import os

import pytest
import torch
import torch.nn.functional as F

from lockstep.models.layers import hc_projection_triton as hp
from lockstep.models.layers import hyper_connection
from lockstep.models.layers.hyper_connection import HyperConnection, HyperHead
from lockstep.models.layers.norm import RMSNorm, rms_norm
from lockstep.models.layers.whole_rows import whole_rows

needs_triton = pytest.mark.skipif(hp.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"
# aot_eager traces the op's body on fake tensors, which interpreted kernels (CPU) cannot run on
COMPILE_BACKENDS = ["eager", "aot_eager"] if DEVICE == "cuda" else ["eager"]
EPS = 1e-6


def _inputs(seed, T, J, K, dtype):
    """x [T, K] like the streams (~N(0, 1), rounded to dtype), fn [J, K] fp32 like mHC's."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K, generator=g) * 3).to(dtype)
    fn = torch.randn(J, K, generator=g) * 0.02
    return x.to(DEVICE), fn.to(DEVICE)


def _reference(x, fn):
    return F.linear(rms_norm(x.float(), EPS), fn.float())


def _assert_close(out, ref, fn):
    # fp32 roundings in another order: relative ~1e-6 of the terms' magnitudes, which bound the
    # error also where a sum cancels; rms_norm(x) has entries ~1, so sum_k |xn_k fn_jk| ~ sum_k |fn_jk|
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * fn.abs().sum(-1).max().item())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 17, 64])  # one row; a partial tile (BLOCK_T = 16); the decode batch
# 328: two splits of 192 (3 tiles of 64), the second cut short by K mid-tile
@pytest.mark.parametrize("J,K", [(24, 256), (4, 512), (24, 328)])
def test_mixes_equal_the_reference(dtype, T, J, K):
    x, fn = _inputs(T * J + K, T, J, K, dtype)
    assert hp.available(x, fn)
    _assert_close(hp.hc_mixes(x, fn, EPS), _reference(x, fn), fn)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixes_at_full_width(dtype):
    # DeepSeek-V4's K = n * D = 4096 (32 splits of 128); few rows, for the interpreter's sake
    x, fn = _inputs(1, 3, 24, 4096, dtype)
    _assert_close(hp.hc_mixes(x, fn, EPS), _reference(x, fn), fn)


@needs_triton
def test_partials_hold_the_products_and_the_sums_of_squares():
    # small multiples of 1/8: every fp32 sum is exact whatever the order, so split by split the
    # partials equal the sums, bit for bit; a strided x (every other column of a wider tensor)
    g = torch.Generator().manual_seed(7)
    wide = (torch.randint(-8, 9, (17, 2 * 320), generator=g) / 8).bfloat16().to(DEVICE)
    x = wide[:, ::2]
    fn = (torch.randint(-8, 9, (24, 320), generator=g) / 8).to(DEVICE)
    split = 4  # 320 / 4 = 80 -> 128 of K per split (2 tiles of 64): two full splits, a short one, an empty one
    partials = hp.hc_mix_partials(x, fn, split)
    assert partials.shape == (split, 17, 25) and partials.dtype == torch.float32
    xf = x.float()
    for s, k0 in enumerate(range(0, 4 * 128, 128)):
        chunk = xf[:, k0:k0 + 128]
        assert torch.equal(partials[s, :, :24], chunk @ fn[:, k0:k0 + 128].t())
        assert torch.equal(partials[s, :, 24], chunk.square().sum(-1))
    assert torch.equal(partials.sum(0)[:, 24], xf.square().sum(-1))
    # the launch config's overrides change the tiling, not the sums (BLOCK_K = 16: splits of 80)
    assert torch.equal(hp.hc_mix_partials(x, fn, split, block_t=32, num_warps=2, num_stages=1), partials)
    assert torch.equal(hp.hc_mix_partials(x, fn, split, block_k=16).sum(0), partials.sum(0))
    # eighths are exact in tf32 too: the GPU's two precisions agree here (the interpreter takes neither)
    assert torch.equal(hp.hc_mix_partials(x, fn, split, precision="ieee"), partials)


@needs_triton
def test_a_rows_partials_do_not_depend_on_the_batch():
    x, fn = _inputs(8, 300, 24, 256, torch.bfloat16)
    split = hp.default_split(256)
    batch = hp.hc_mix_partials(x, fn, split)
    for t in (0, 17, 299):
        assert torch.equal(hp.hc_mix_partials(x[t:t + 1], fn, split), batch[:, t:t + 1])


@needs_triton
def test_mixes_in_order_do_not_depend_on_the_batch():
    x, fn = _inputs(12, 150, 24, 1024, torch.bfloat16)
    batch = hp.hc_mixes(x, fn, EPS, in_order=True)
    _assert_close(batch, _reference(x, fn), fn)
    for t in (0, 77, 149):
        assert torch.equal(hp.hc_mixes(x[t:t + 1], fn, EPS, in_order=True), batch[t:t + 1])


@needs_triton
@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_op_traces_whole_under_torch_compile(backend):
    x, fn = _inputs(9, 17, 24, 256, torch.bfloat16)

    def mixes(x, fn):
        return torch.sigmoid(hp.hc_mixes(x, fn, EPS))

    torch._dynamo.reset()
    compiled = torch.compile(mixes, backend=backend, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, fn), mixes(x, fn))


def test_available_only_where_the_kernel_runs():
    x, fn = torch.ones(3, 64), torch.ones(24, 64)
    if hp.triton is None:
        assert not hp.available(x, fn)
        return
    assert hp.available(x, fn) and hp.available(x.bfloat16(), fn) and hp.available(x.view(3, 4, 16).flatten(-2), fn)
    assert not hp.available(torch.ones(0, 64), fn)  # no rows
    assert not hp.available(x, torch.ones(24, 32))  # K mismatch
    assert not hp.available(x.double(), fn)
    assert not hp.available(x, torch.ones(hp.MAX_J + 1, 64))


@needs_triton
def test_hyper_connections_take_the_kernel_without_gradients(monkeypatch):
    torch.manual_seed(10)
    n, D = 4, 32
    hc = HyperConnection(n, D, sinkhorn_iters=5, hc_eps=1e-6, norm_eps=EPS).to(DEVICE)
    head = HyperHead(n, D, hc_eps=1e-6, norm_eps=EPS).to(DEVICE)
    for p in (hc.fn, head.hc_fn):
        torch.nn.init.normal_(p, std=0.05)
    streams = torch.randn(2, 5, n, D, device=DEVICE).bfloat16()  # leading dims [B, S]
    x = streams.flatten(-2)
    step = streams[:, :1]  # a decode step: one new token per row

    with torch.no_grad():
        assert hyper_connection._triton_mixes(step, hc.fn, True) == (DEVICE == "cuda")
        assert not hyper_connection._triton_mixes(streams, hc.fn, True)  # prefill: cuBLAS
        assert not hyper_connection._triton_mixes(step, hc.fn, False)  # switched off
    assert not hyper_connection._triton_mixes(step, hc.fn, True)  # gradients wanted (fn is a parameter)

    with torch.no_grad():
        monkeypatch.setattr(hyper_connection, "_triton_mixes", lambda *args: False)
        ref_hc, ref_head = hc(streams), head(streams)
        monkeypatch.setattr(hyper_connection, "_triton_mixes", lambda *args: True)
        mixes = hyper_connection._mixes(streams, hc.fn, EPS, True)
        assert mixes.shape == (2, 5, (2 + n) * n)
        _assert_close(mixes, _reference(x, hc.fn), hc.fn)
        fused_hc, fused_head = hc(streams), head(streams)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(head, backend="eager", fullgraph=True)(streams), fused_head)
    # the coefficients move by fp32 roundings; the collapsed streams by at most a bf16 ulp
    for out, ref in zip((*fused_hc, fused_head), (*ref_hc, ref_head)):
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7 if out.dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5)


def _combine_inputs(T, n, D, seed):
    """Streams [T, n, D] and a block output y [T, D] (bf16), post [T, n] in (0, 2) and comb [T, n, n]
    rows of a doubly stochastic scale (fp32, as hc_pre_step gives them)."""
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(T, n, D, generator=g) * 3).bfloat16()
    y = torch.randn(T, D, generator=g).bfloat16()
    post = torch.rand(T, n, generator=g) * 2
    comb = torch.softmax(torch.randn(T, n, n, generator=g), -1)
    return [t.to(DEVICE) for t in (streams, y, post, comb)]


@needs_triton
@pytest.mark.parametrize("T,D", [(5, 1024), (17, 128)])
def test_the_combine_rides_the_partials_kernel(T, D):
    """hc_combine_partials: the combined streams are hc_combine's (eager's roundings, the sum over j
    in order: its whole-rows form) and the partials those of the combined streams, bit for bit on
    the CPU (on a GPU the mix's fp32 sum may contract into fmas: within a bf16 ulp)."""
    n = 4
    streams, y, post, comb = _combine_inputs(T, n, D, D + T)
    fn = (torch.randn((2 + n) * n, n * D, generator=torch.Generator().manual_seed(1)) * 0.02).to(DEVICE)
    assert hp.combines(n, D, fn)
    split = hp.default_split(n * D)
    partials, combined = hp.hc_combine_partials(streams, y, post, comb, fn, split)
    with whole_rows():  # hc_combine's sum over j in order
        want = hyper_connection.hc_combine(streams, y, post, comb)
    assert combined.shape == streams.shape and combined.dtype == torch.bfloat16
    if DEVICE == "cuda":
        diff = (combined.float() - want.float()).abs()
        assert (diff <= 2 ** -7 * want.float().abs()).all()
    else:
        assert torch.equal(combined, want)
    assert torch.equal(partials, hp.hc_mix_partials(combined.flatten(-2), fn, split))


@needs_triton
def test_a_decode_step_combines_in_the_partials_kernel(monkeypatch):
    """HyperConnection.after at a decode step (the kernels' path, forced on this CPU): the combine
    inside the partials' kernel, the same streams, block input and coefficients as hc_combine then
    the connection's forward; elsewhere exactly those."""
    n, D, T = 4, 128, 3
    hc = HyperConnection(n, D, 20, 1e-6, 1e-6)
    torch.nn.init.normal_(hc.fn, std=0.02)
    norm = RMSNorm(D).to(DEVICE, torch.bfloat16)
    hc = hc.to(DEVICE)
    streams, y, post, comb = _combine_inputs(T, n, D, 5)
    streams, y, post, comb = streams[:, None], y[:, None], post[:, None], comb[:, None]  # [N, S = 1, ...]
    with torch.no_grad():
        combined_ref = hyper_connection.hc_combine(streams, y, post, comb)
        ref = hc(combined_ref, norm)
        assert all(torch.equal(a, b) for a, b in zip(hc.after(streams, y, post, comb, norm), (combined_ref, *ref)))
        calls, kernel = [], hp.hc_combine_partials
        monkeypatch.setattr(hyper_connection, "_triton_mixes", lambda *a: True)
        monkeypatch.setattr(hp, "hc_combine_partials", lambda *a: calls.append(a) or kernel(*a))
        got = hc.after(streams, y, post, comb, norm)
    assert len(calls) == 1
    for a, b in zip(got, (combined_ref, *ref)):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=2 ** -7 * b.float().abs().max().item())
