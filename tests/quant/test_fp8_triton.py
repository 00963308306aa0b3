"""The Triton fp8 block-quantisation kernel against the pure-PyTorch reference, bit for bit (CPU: TRITON_INTERPRET=1)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the @triton.jit decoration

import pytest
import torch

pytest.importorskip("triton")

from lockstep.quant.fp8 import quantize_fp8_block  # noqa: E402
from lockstep.quant.fp8_triton import quantize_fp8_block_triton  # noqa: E402


def _same(a, b):
    (qa, sa), (qb, sb) = a, b
    assert torch.equal(sa, sb)
    assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize(
    "shape,block,dtype",
    [((260, 300), (128, 128), torch.bfloat16), ((2, 70, 100), (32, 64), torch.float32), ((5, 3), (4, 2), torch.float16)],
)
def test_triton_matches_reference(shape, block, dtype, scale_fmt):
    torch.manual_seed(0)
    span = 3 if dtype == torch.float16 else 6  # keep fp16 finite
    w = (torch.randn(shape) * torch.logspace(-span, span, shape[-1])).to(dtype)
    _same(quantize_fp8_block_triton(w, block, scale_fmt), quantize_fp8_block(w, block, scale_fmt))


def test_triton_edge_cases_match_reference():
    w = torch.randn(16, 64)
    w[:4] = 0.0  # zero block -> scale 1
    w[4:8] = 0.0
    w[4, 0] = 1e-40  # subnormal amax: ue8m0 scale bottoms out at 2**-127
    w[8:12] = 0.0
    w[8, 1] = -448 * 2**-126.5  # amax / 448 between 2**-127 and 2**-126
    w[12, 0] = 448 * 3  # hand-checked: scale 4
    w[12, 1] = -(2**-20)  # rounds to -0.0, which must keep its sign
    for fmt in ("ue8m0", "fp32"):
        _same(quantize_fp8_block_triton(w, (4, 64), fmt), quantize_fp8_block(w, (4, 64), fmt))
    q, s = quantize_fp8_block_triton(w, (4, 64))
    assert s.flatten().tolist() == [1.0, 2.0**-127, 2.0**-126, 4.0]


def test_triton_rejects_non_power_of_two_blocks():
    with pytest.raises(ValueError, match="power-of-two"):
        quantize_fp8_block_triton(torch.randn(8, 8), (3, 4))
