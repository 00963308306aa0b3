"""fp32 operands as three bf16 parts (models/layers/bf16x3.py): the parts add up to the value
exactly, and the split GEMMs are as accurate as the fp32 GEMM of the upcast operands."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.layers import bf16x3 as split
from lockstep.models.layers.bf16x3 import bf16x3, mm_bf16_fp32, mm_fp32_bf16


def test_the_three_parts_add_up_to_the_value_exactly():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4000, generator=g) * torch.logspace(-30, 30, 4000)  # far from the subnormals either way
    parts = bf16x3(t)
    assert parts.shape == (3, 4000) and parts.dtype == torch.bfloat16
    assert torch.equal(parts.double().sum(0), t.double())
    assert torch.equal(parts[0], t.bfloat16())  # hi is the bf16 rounding; mid and lo its remainders


@pytest.mark.skipif(split.triton is None, reason="Triton is not installed")
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's inf - inf, meant
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_split_kernel_gives_the_eager_casts_bits(monkeypatch, dim, transposed):
    """A matrix's split by the kernel (the interpreter here, compiled on a GPU), read through any
    strides (the GEMMs split transposed views) and stacked where the GEMM reads it, equals the eager
    casts' bit for bit, over fp32's normal range, zeros and infinities (NaN where they give NaN)."""
    g = torch.Generator().manual_seed(2)
    t = torch.randn(37, 300, generator=g) * torch.logspace(-30, 30, 300)
    t[0, :5] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
    t = t.to(DEVICE)
    t = t.t() if transposed else t  # a view: strides (1, 300)
    got = bf16x3(t, dim)
    monkeypatch.setattr(split, "triton", None)  # the eager casts
    want = bf16x3(t, dim)
    assert got.shape == want.shape == ((3, *t.shape) if dim == 0 else (t.shape[0], 3, t.shape[1]))
    nan = want.isnan()  # inf's remainders (inf - inf): NaN either way, its sign bit the machine's
    assert torch.equal(got.isnan(), nan) and nan.any()
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def _rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


# On a GPU the split GEMM runs on tensor cores, which add the products inside each MMA with
# truncation rather than round-to-nearest (Fasi et al., "Numerical behavior of NVIDIA tensor
# cores", 2021): measured on an H200, 6.9e-7 against the fp32 GEMM's
# 1.2e-7 here, still ~1000x below what rounding the fp32 operand to bf16 costs.
TOLERANCE = 1e-7 if DEVICE == "cpu" else 1e-6


def test_split_products_are_as_accurate_as_the_fp32_gemm():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 512, generator=g).bfloat16().to(DEVICE)
    w = torch.randn(512, 24, generator=g).to(DEVICE)  # fp32, bits below bf16's
    ref = x.double() @ w.double()
    fp32 = _rel(x.float() @ w, ref)
    assert _rel(mm_bf16_fp32(x, w), ref) < 4 * fp32 + TOLERANCE
    assert _rel(x.float() @ w.bfloat16().float(), ref) > 100 * fp32  # w rounded to bf16 is far worse
    gr = torch.randn(24, 64, generator=g).to(DEVICE)
    ref = gr.double() @ x.double()
    assert _rel(mm_fp32_bf16(gr, x), ref) < 4 * _rel(gr @ x.float(), ref) + TOLERANCE
    assert mm_bf16_fp32(x, w).dtype == mm_fp32_bf16(gr, x).dtype == torch.float32
