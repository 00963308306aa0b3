"""The grouped GEMM over packed fp8 experts (grouped_gemm_fp8.py) against its reference (dequantise,
then grouped_mm_reference) under Triton's interpreter (TRITON_INTERPRET=1, conftest.py;
LOCKSTEP_TEST_DEVICE=cuda runs it on a GPU), on the group layout of test_grouped_gemm_triton.py."""

import os

import pytest
import torch

from lockstep.models.layers import grouped_gemm_fp8 as g8
from lockstep.models.layers.moe import swiglu_clamped
from lockstep.quant.fp8 import quantize_fp8_block

needs_triton = pytest.mark.skipif(g8.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"

COUNTS = [0, 3, 40, 0, 7, 1, 0]  # empty first, middle and last groups; one of 3 row tiles
# N and K off the tiles and the 128 blocks (200 rows: a ragged second scale row; K 72 = 2 x 32 + 8),
# the default config, and K = 300 over 128-wide steps with a ragged last scale column
SHAPES = [(200, 72, dict(block_n=32, block_k=32)), (48, 64, {}), (24, 300, {})]


def _setup(seed, N, K, values=None):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(COUNTS)
    M, G = int(counts.sum()), len(COUNTS)
    if values is None:
        x, w = torch.randn(M, K, generator=g), torch.randn(G, N, K, generator=g) * 0.1
    else:
        x, w = values(g, (M, K)), values(g, (G, N, K))
    q, scale = quantize_fp8_block(w)
    offs = counts.cumsum(0).to(torch.int32)
    return x.bfloat16().to(DEVICE), q.to(DEVICE), scale.to(DEVICE), counts, offs.to(DEVICE)


def _reference(x, q, scale, counts):
    return g8.grouped_mm_fp8_reference(x.float(), q, scale, counts).bfloat16()  # fp32, rounded once


def _eighths_pow2(g, shape):
    return (torch.randint(-8, 9, shape, generator=g) / 8) * 2.0 ** torch.randint(-2, 2, shape, generator=g)


@needs_triton
@pytest.mark.parametrize("N,K,cfg", SHAPES)
def test_grouped_fp8_equals_dequantise_then_grouped_mm(N, K, cfg):
    x, q, scale, counts, offs = _setup(0, N, K)
    out = g8.grouped_mm_fp8(x, q, scale, offs, **cfg)
    ref = _reference(x, q, scale, counts)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-5)  # summation order: 1 ulp
    x, q, scale, counts, offs = _setup(1, N, K, _eighths_pow2)
    assert torch.equal(g8.grouped_mm_fp8(x, q, scale, offs, **cfg), _reference(x, q, scale, counts))
    scale[2, -1, 0] *= 2  # the scales enter block by block (group 2, last row block, first column block)
    out2 = g8.grouped_mm_fp8(x, q, scale, offs, **cfg)
    assert torch.equal(out2, _reference(x, q, scale, counts))
    rows2 = slice(3, 43)
    changed = (out2 != g8.grouped_mm_fp8(x, q, scale * torch.where(torch.arange(len(COUNTS), device=DEVICE) == 2,
                                                                   0.5, 1.0)[:, None, None], offs, **cfg))
    assert not changed[:3].any() and not changed[43:].any() and changed[rows2].any()


@needs_triton
def test_shared_groups_read_the_shared_experts_bytes_and_scales():
    # the shared expert's rows after the routed ones (grouped_gemm_triton.with_shared_groups): exact
    # sums, so its rows equal a group of its own and the routed rows are untouched
    from lockstep.models.layers.grouped_gemm_triton import with_shared_groups

    x, q, scale, counts, offs = _setup(2, 200, 72, _eighths_pow2)
    g = torch.Generator().manual_seed(3)
    T = 21
    xs = _eighths_pow2(g, (T, 72)).bfloat16().to(DEVICE)
    qs, ss = (t.to(DEVICE) for t in quantize_fp8_block(_eighths_pow2(g, (200, 72))))
    ss[1, 0] = 4.0  # its own scales, not the last routed expert's
    out = g8.grouped_mm_fp8(torch.cat([x, xs]), q, scale, with_shared_groups(offs, T), shared=(qs, ss))
    assert torch.equal(out[:len(x)], _reference(x, q, scale, counts))
    assert torch.equal(out[len(x):], _reference(xs, qs[None], ss[None], torch.tensor([T])))
    # the same rows read through an index (a decode step's dispatch: no gathered copy), in another order
    rows = torch.cat([x, xs])
    perm = torch.randperm(len(rows), generator=g).to(DEVICE)
    source = torch.empty_like(rows).index_copy_(0, perm, rows)  # source[perm[i]] = rows[i]
    assert torch.equal(g8.grouped_mm_fp8(source, q, scale, with_shared_groups(offs, T), shared=(qs, ss), rows=perm),
                       out)
    with pytest.raises(ValueError, match="shared expert's fp8 scale"):
        g8.grouped_mm_fp8(torch.cat([x, xs]), q, scale, with_shared_groups(offs, T), shared=(qs, ss[:1]))


@needs_triton
# F = 100: the up rows start inside a scale block (their scales: the rows' own, (n + F) // 128); F = 128:
# block-aligned, as the 1b config's 512; the default config and 32 columns a program
@pytest.mark.parametrize("F,cfg", [(100, dict(block_n=32, block_k=32)), (128, {})])
def test_the_fused_swiglu_is_the_bf16_fused_kernel_on_the_dequantised_experts(F, cfg):
    """grouped_swiglu_fp8 equals grouped_gemm_triton.grouped_swiglu over dequant(w) bit for bit (the
    same tiles' dot products and the same SwiGLU roundings), shared groups included."""
    from lockstep.models.layers import grouped_gemm_triton as gt
    from lockstep.quant.fp8 import dequantize_fp8_block

    x, q, scale, counts, offs = _setup(4, 2 * F, 72)
    g = torch.Generator().manual_seed(5)
    T = 9
    xs = torch.randn(T, 72, generator=g).bfloat16().to(DEVICE)
    shared = tuple(t.to(DEVICE) for t in quantize_fp8_block(torch.randn(2 * F, 72, generator=g) * 0.1))
    rows, ext = torch.cat([x, xs]), gt.with_shared_groups(offs, T)
    got = g8.grouped_swiglu_fp8(rows, q, scale, ext, 7.0, shared=shared, **cfg)
    dq = dequantize_fp8_block(q, scale, torch.bfloat16)
    want = gt.grouped_swiglu(rows, dq, ext, 7.0, **cfg, shared=dequantize_fp8_block(*shared, torch.bfloat16))
    assert got.shape == (len(rows), F) and torch.equal(got, want)
    unfused = g8.grouped_mm_fp8(x, q, scale, offs, **cfg)  # the two-step form it replaces: to rounding
    ref = swiglu_clamped(*unfused.chunk(2, dim=-1), 7.0)
    torch.testing.assert_close(got[:len(x)].float(), ref.float(), rtol=2**-7, atol=2**-7 * ref.abs().max().item())
