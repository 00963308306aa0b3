"""The grouped GEMM over packed fp4 experts (grouped_gemm_fp4.py) against its reference (dequantise,
then grouped_mm_reference) under Triton's interpreter (TRITON_INTERPRET=1, conftest.py;
LOCKSTEP_TEST_DEVICE=cuda runs it on a GPU), on the group layout of test_grouped_gemm_triton.py."""

import os

import pytest
import torch

from lockstep.models.layers import grouped_gemm_fp4 as g4
from lockstep.quant.fp4 import dequantize_fp4_block, quantize_fp4_block

needs_triton = pytest.mark.skipif(g4.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"

# first and last groups empty, one empty in between, one of 40 rows (3 tiles of BLOCK_M = 16)
COUNTS = [0, 3, 40, 0, 7, 1, 0]
# N and K not multiples of the blocks (72 = 2 x 32 + 8: a ragged last scale block and K step),
# the default config (BLOCK_K 64 = K), and K = 200 = 128 + 72 over default 128-wide steps
SHAPES = [(48, 72, dict(block_n=32, block_k=32)), (48, 64, {}), (24, 200, {})]


def _setup(seed, N, K, values=None):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(COUNTS)
    M, G = int(counts.sum()), len(COUNTS)
    if values is None:
        x, w = torch.randn(M, K, generator=g), torch.randn(G, N, K, generator=g) * 0.1
    else:
        x, w = values(g, (M, K)), values(g, (G, N, K))
    packed, scale = quantize_fp4_block(w)  # e8m0 scales
    offs = counts.cumsum(0).to(torch.int32)
    return (x.bfloat16().to(DEVICE), packed.to(DEVICE), scale.view(torch.uint8).to(DEVICE), counts,
            offs.to(DEVICE))


def _reference(x, packed, scale, counts):
    """In fp32, rounded once to bf16."""
    return g4.grouped_mm_fp4_reference(x.float(), packed, scale, counts).bfloat16()


def _e2m1_times_pow2(g, shape):
    # exact e2m1 values times small powers of two: fp4 round trips exactly, fp32 sums are exact
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    v = values[torch.randint(0, 8, shape, generator=g)] * torch.where(torch.rand(shape, generator=g) < 0.5, -1, 1)
    return v * 2.0 ** torch.randint(-2, 2, shape, generator=g)


@needs_triton
@pytest.mark.parametrize("N,K,cfg", SHAPES)
def test_grouped_fp4_equals_dequantise_then_grouped_mm(N, K, cfg):
    x, packed, scale, counts, offs = _setup(0, N, K)
    out = g4.grouped_mm_fp4(x, packed, scale, offs, **cfg)
    ref = _reference(x, packed, scale, counts)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-5)  # summation order: 1 ulp
    x, packed, scale, counts, offs = _setup(1, N, K, _e2m1_times_pow2)
    assert torch.equal(g4.grouped_mm_fp4(x, packed, scale, offs, **cfg), _reference(x, packed, scale, counts))


@needs_triton
def test_every_code_and_scale_decodes():
    """All 16 codes in both nibbles, under scales from 2**-27 to 2**8 (byte 0, 2**-127, makes
    subnormal products, which may flush to zero: no trained weight has such a block): one row of x
    picks each weight column, so the output is the dequantised weight itself."""
    N, K = 16, 64
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[:, None] | (codes.flip(0)[:, None] << 4)).expand(N, K // 2).contiguous()
    scale = torch.tensor([[100, 127], [120, 135]], dtype=torch.uint8).repeat(N // 2, 1)  # [N, 2]
    w = dequantize_fp4_block(packed, scale.view(torch.float8_e8m0fnu), torch.float32)
    assert len(set(w.abs().flatten().tolist())) == 4 * 8 - 3  # 8 magnitudes x 4 scales (0 counted once)
    eye = torch.eye(K).bfloat16().to(DEVICE)
    offs = torch.tensor([K], dtype=torch.int32, device=DEVICE)
    out = g4.grouped_mm_fp4(eye, packed[None].to(DEVICE), scale[None].to(DEVICE), offs)
    assert torch.equal(out.float().cpu(), w.T.bfloat16().float())
