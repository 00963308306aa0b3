"""fp32 operands as three bf16 parts (models/layers/bf16x3.py): the parts add up to the value
exactly, and the split GEMMs are as accurate as the fp32 GEMM of the upcast operands."""

import torch

from devices import DEVICE
from lockstep.models.layers.bf16x3 import bf16x3, mm_bf16_fp32, mm_fp32_bf16


def test_the_three_parts_add_up_to_the_value_exactly():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4000, generator=g) * torch.logspace(-30, 30, 4000)  # far from the subnormals either way
    parts = bf16x3(t)
    assert parts.shape == (3, 4000) and parts.dtype == torch.bfloat16
    assert torch.equal(parts.double().sum(0), t.double())
    assert torch.equal(parts[0], t.bfloat16())  # hi is the bf16 rounding; mid and lo its remainders


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
