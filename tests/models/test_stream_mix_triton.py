"""mHC's per-token stream mix (stream_mix_triton.py): the Triton kernel against its PyTorch
reference (the same bits: bf16 products, fp32 sums in stream order, one rounding) and the batched
GEMM it replaces (to rounding), and StreamCombine's forward bits and gradients. Under
Triton's interpreter here (TRITON_INTERPRET=1, conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs it on a GPU."""


import pytest
import torch

from lockstep.models.layers import stream_mix_triton as sm
from devices import DEVICE

needs_triton = pytest.mark.skipif(sm.triton is None, reason="triton is not installed")


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
@pytest.mark.parametrize("n", [4, 3])
def test_the_combine_keeps_the_eager_bits_and_its_gradients_are_fp32_accurate(n):
    """StreamCombine (hc_combine's post_k y + comb^T X): bf16 forward equal to the eager ops, gradients
    against fp64 autograd of the same formula (d X, d y rounded to bf16 once; d post, d comb fp32).
    n = 3: the backward's padded rows take any number of streams."""
    T, D = 6, 600  # D over the backward's 128-element passes: a partial fifth
    comb, streams = _operands(T=T, n=n, D=D)
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(T, D, generator=g) * 2).to(DEVICE, torch.bfloat16)
    post = (torch.rand(T, n, generator=g) * 2).to(DEVICE, torch.bfloat16)
    w = torch.randn(T, n, D, generator=g).to(DEVICE, torch.bfloat16)
    ins = [t.clone().requires_grad_() for t in (streams, y, post, comb)]
    out = sm.StreamCombine.apply(*ins)
    assert torch.equal(out, sm.stream_combine_reference(comb, streams, post, y))
    if DEVICE == "cpu":  # a GPU's bf16 GEMM adds its products in its own way (tensor cores)
        assert torch.equal(out, post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams))
    (out * w).sum().backward()
    ref = [t.double().requires_grad_() for t in (streams, y, post, comb)]
    x64, y64, p64, c64 = ref
    ((p64.unsqueeze(-1) * y64.unsqueeze(-2) + torch.matmul(c64.transpose(-1, -2), x64)) * w.double()).sum().backward()
    for got, want in zip(ins, ref):
        scale = want.grad.abs().max().item()
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-2, atol=1e-2 * scale)  # bf16 outputs
    # fp32 sums: d post and d comb are fp32-accurate before their cast to bf16
    d = sm.stream_combine_backward_op(comb, streams, post, y, w)
    torch.testing.assert_close(d[2].double(), p64.grad, rtol=1e-5, atol=1e-5 * p64.grad.abs().max().item())
    torch.testing.assert_close(d[3].double(), c64.grad, rtol=1e-5, atol=1e-5 * c64.grad.abs().max().item())


@pytest.mark.skipif(sm.triton is None, reason="triton is not installed")
def test_the_combine_keeps_two_roundings_in_the_gpu_code():
    """The interpreter cannot see what the GPU compiler does: with FP fusion on (Triton 3.6's
    default, the GPU image's) LLVM narrowed the rounded post * y and the add to bf16 ops and fused
    them into one fma.rn.bf16, one rounding where eager has two. Compiled here to sm_90 PTX
    (tests/gpu_compile.py): no bf16 fma, and the bf16 rounding of the sums is there."""
    from test_kernels_compile_for_gpu import compile_for_gpu

    code = compile_for_gpu("stream-mix")
    assert "cvt.rn.bf16" in code and "fma.rn.bf16" not in code


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


def _eager_collapse(pre, streams):
    return (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)


def _collapse_operands(T=7, n=4, D=1100, seed=3):  # D over one program's 1024: a second, partial block
    g = torch.Generator().manual_seed(seed)
    pre = (torch.rand(T, n, generator=g) + 0.5).to(DEVICE)
    streams = (torch.randn(T, n, D, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    return pre, streams, torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEVICE)


@needs_triton
def test_collapse_is_the_eager_collapse_with_its_gradients():
    """Collapse (the mix into one output, fp32 weights) against the eager ops and their autograd: the
    same bits under the interpreter (a GPU's fused multiply-add may round the fp32 products once
    less), d pre to fp32 rounding (summed in another order)."""
    pre, streams, w = _collapse_operands()
    results = []
    for collapse in (_eager_collapse, lambda p, x: sm.Collapse.apply(p, x)[0]):
        p, x = pre.clone().requires_grad_(), streams.clone().requires_grad_()
        out = collapse(p, x)
        (out.float() * w.float()).sum().backward()
        results.append((out, p.grad, x.grad))
    (ref, ref_pre, ref_x), (out, d_pre, d_x) = results
    assert out.dtype == d_x.dtype == torch.bfloat16 and d_pre.dtype == torch.float32
    if DEVICE == "cpu":
        assert torch.equal(out, ref) and torch.equal(d_x, ref_x)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(d_x.float(), ref_x.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(d_pre, ref_pre, rtol=1e-5, atol=1e-5 * ref_pre.abs().max().item())
    # a token's values are its own: alone, the same bits
    alone = sm.collapse_backward_op(pre[4:5], streams[4:5], w[4:5])
    both = sm.collapse_backward_op(pre, streams, w)
    assert torch.equal(alone[0], both[0][4:5]) and torch.equal(alone[1], both[1][4:5])


def test_hc_collapse_takes_the_kernels_only_with_a_gradient_on_a_gpu(monkeypatch):
    """_collapse's rule: the kernels where the trainer's eager forward wants a gradient on CUDA;
    routed there (by the rule's own switch, under the interpreter here) it gives the eager values."""
    from lockstep.models.layers import hyper_connection as hc

    pre, streams, _ = _collapse_operands(T=6)
    assert not hc._collapse_kernels(pre, streams.requires_grad_()) or DEVICE == "cuda"
    with torch.no_grad():
        assert not hc._collapse_kernels(pre, streams)
    if sm.triton is None:
        return
    monkeypatch.setattr(hc, "_collapse_kernels", lambda *_: True)
    out = hc._collapse(pre.view(2, 3, 4), streams.view(2, 3, 4, -1))
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "CollapseBackward" and out.shape == (2, 3, 1100)
    torch.testing.assert_close(out.view(6, -1).float(), _eager_collapse(pre, streams).float(), rtol=1e-2, atol=1e-2)
