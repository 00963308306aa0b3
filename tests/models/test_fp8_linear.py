"""The packed fp8 linear (models/layers/fp8_linear.py): the Triton kernel against its torch
reference (dequantise, then matmul) under Triton's interpreter (TRITON_INTERPRET=1, conftest.py;
LOCKSTEP_TEST_DEVICE=cuda runs it on a GPU), the reference against the emulation the engine
served before (quant.serving_format.served_value), and packed projections fused with plain ones."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lockstep.models.layers import fp8_linear as fl
from lockstep.models.layers.attention import GroupedLinear
from lockstep.models.layers.fused_linear import fuse_linears, is_fused, project
from lockstep.quant.fp8 import dequantize_fp8_block, quantize_fp8_block
from lockstep.quant.serving_format import served_value

needs_triton = pytest.mark.skipif(fl.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"

# (M, N, K, n_groups, block_n, block_k): N and K not multiples of the tiles or of 128 (300 = 2 x 128
# + 44: a ragged last scale column; 200 rows: a ragged last scale row); small tiles so a scale
# column spans several K steps; M = 20 > 16 rows (two row tiles); two groups of 136 rows, so
# group 1's first rows share a 128-row block with group 0's last ones; decode's single row
SHAPES = [(5, 200, 300, 0, 0, 0), (20, 130, 96, 0, 32, 32), (3, 272, 72, 2, 0, 0), (1, 64, 256, 0, 16, 64)]


def _packed(seed, N, K, values=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05 if values is None else values(g, (N, K))
    q, s = quantize_fp8_block(w, scale_fmt="ue8m0")
    return q.to(DEVICE), s.to(DEVICE), fl.block_scale_rows(N).to(DEVICE)


def _x(seed, M, K, G, values=None):
    g = torch.Generator().manual_seed(seed)
    shape = (M, G, K) if G else (M, K)
    x = torch.randn(shape, generator=g) if values is None else values(g, shape)
    return x.bfloat16().to(DEVICE)


def _reference(x, q, s, sr, G):
    """In fp32, rounded once to bf16."""
    if G:
        return fl.fp8_grouped_reference(x.float(), q, s, sr, G).bfloat16()
    return fl.fp8_linear_reference(x.float(), q, s, sr).bfloat16()


def _eighths_pow2(g, shape):
    # small multiples of 1/8 times powers of two: exact e4m3 values, exact fp32 partial sums
    return (torch.randint(-8, 9, shape, generator=g) / 8) * 2.0 ** torch.randint(-2, 2, shape, generator=g)


@needs_triton
@pytest.mark.parametrize("M,N,K,G,bn,bk", SHAPES)
def test_kernel_equals_dequantise_then_matmul(M, N, K, G, bn, bk):
    q, s, sr = _packed(0, N, K)
    x = _x(1, M, K, G)
    out = fl.fp8_gemm(x, q, s, sr, G, block_n=bn, block_k=bk)
    ref = _reference(x, q, s, sr, G)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    # fp32 sums in another order: at most one bf16 ulp apart
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-5)
    # exact sums: the same bf16 values
    q, s, sr = _packed(2, N, K, _eighths_pow2)
    x = _x(3, M, K, G, _eighths_pow2)
    assert torch.equal(fl.fp8_gemm(x, q, s, sr, G, block_n=bn, block_k=bk), _reference(x, q, s, sr, G))


@needs_triton
def test_kernel_reads_each_rows_block_scale():
    """The scales really enter: a scale table whose rows are permuted (scale_row says where each
    row's went) gives the same product; doubling one block's scale changes exactly its rows."""
    N, K = 256, 256
    q, s, sr = _packed(4, N, K, _eighths_pow2)
    x = _x(5, 4, K, 0, _eighths_pow2)
    out = fl.fp8_gemm(x, q, s, sr)
    perm = torch.tensor([1, 0], device=DEVICE)
    assert torch.equal(fl.fp8_gemm(x, q, s[perm], perm[sr.long()].to(torch.int32)), out)
    s2 = s.clone()
    s2[1, 0] *= 2  # rows 128..255, columns 0..127
    doubled = fl.fp8_gemm(x, q, s2, sr)
    assert torch.equal(doubled, _reference(x, q, s2, sr, 0))
    assert torch.equal(doubled[:, :128], out[:, :128]) and not torch.equal(doubled[:, 128:], out[:, 128:])
    assert fl.fp8_gemm(x[:0], q, s, sr).shape == (0, N)  # no rows: no launch


def test_dequantize_rows_is_the_block_dequantisation():
    q, s, sr = _packed(6, 200, 300)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(fl.dequantize_rows(q, s, sr, dtype), dequantize_fp8_block(q, s, dtype))


@pytest.mark.parametrize("grouped", [False, True])
def test_packed_module_serves_the_emulated_values(grouped):
    """Fp8Linear over packed storage = the old engine's module holding served_value(w) (fp32, CPU:
    the same GEMM on the same values, bitwise)."""
    torch.manual_seed(0)
    lin = GroupedLinear(40, 2 * 72, 2) if grouped else nn.Linear(300, 200, bias=False)
    nn.init.normal_(lin.weight, std=0.05)
    name = "model.layers.0.self_attn." + ("o_a_proj.weight" if grouped else "q_a_proj.weight")
    packed = fl.Fp8Linear.packing(lin)
    assert packed.weight.dtype == torch.float8_e4m3fn and packed.weight.shape == lin.weight.shape
    assert packed.n_groups == (2 if grouped else 0)
    with torch.no_grad():
        lin.weight.copy_(served_value(name, lin.weight, "fp8", torch.float32))
    x = torch.randn(3, 5, 2, 40) if grouped else torch.randn(3, 5, 300)
    assert torch.equal(packed(x), lin(x))
    assert torch.equal(packed.dequantized(torch.float32), lin.weight)


def test_pack_leaves_biased_and_tied_linears_alone():
    model = nn.ModuleDict(dict(a=nn.Linear(8, 8, bias=False), b=nn.Linear(8, 8), c=nn.Linear(8, 8, bias=False),
                               d=nn.Linear(8, 8, bias=False)))
    model["d"].weight = model["c"].weight
    names = fl.pack_fp8_linears(model, lambda name: True)
    assert names == ["a.weight"] and isinstance(model["a"], fl.Fp8Linear)
    assert list(fl.packed_weights(model)) == ["a.weight"]
    assert all(isinstance(model[k], nn.Linear) for k in "bcd")


def test_fused_packed_and_plain_projections():
    """An owner's fp8 weights stack into one matrix and scale table (rows 40 and 72: not 128-aligned,
    each keeps its own blocks), the plain ones into another; outputs come back in order, equal to
    the unfused ones, and an in-place load_ reaches the fused matrix."""
    torch.manual_seed(1)
    owner = nn.Module()
    rows = [40, 24, 72, 8]
    lins = [nn.Linear(96, r, bias=False) for r in rows]
    for lin in lins:
        nn.init.normal_(lin.weight, std=0.05)
    lins[0], lins[2] = fl.Fp8Linear.packing(lins[0]), fl.Fp8Linear.packing(lins[2])
    for i, lin in enumerate(lins):
        owner.add_module(f"l{i}", lin)
    x = torch.randn(6, 96)
    unfused = [lin(x) for lin in lins]
    fuse_linears(owner, lins)
    assert is_fused(owner, lins)
    assert owner.fused_fp8_weight.shape == (112, 96) and owner.fused_weight.shape == (32, 96)
    assert owner.fused_fp8_scale.shape == (2, 1)  # one table row per weight
    assert owner.fused_fp8_scale_row.tolist() == [0] * 40 + [1] * 72
    fused = project(owner, lins, x)
    assert [y.shape[-1] for y in fused] == rows
    # the fp8 ones bitwise (the kernel's tiles follow each weight's own blocks); the plain ones up to
    # rounding: a CPU GEMM's blocking of N may change the sums' order (AVX2 machines: N = 8 vs 32)
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[2], unfused[2])
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(fused, unfused))
    new = torch.randn(72, 96)
    lins[2].load_(new)
    assert is_fused(owner, lins)  # written in place: still the fused matrix's views
    expected = F.linear(x, served_value("model.layers.0.self_attn.kv_proj.weight", new, "fp8", torch.float32))
    assert torch.equal(project(owner, lins, x)[2], expected)
