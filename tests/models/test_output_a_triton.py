"""A decode step's rotation back and grouped output projection wo_a as one Triton kernel
(output_a_triton.py) against attention._output's torch ops (rope.apply_rope with -sin, then
GroupedLinear's einsum or the packed fp8 form's reference). The kernel runs under Triton's
interpreter here (TRITON_INTERPRET=1, conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs it on a GPU."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.deepseek_v4_init import tiny_config
from lockstep.models.layers import output_a_triton as oa
from lockstep.models.layers.attention import DeepseekV4Attention, GroupedLinear
from lockstep.models.layers.fp8_linear import Fp8Linear, fp8_grouped_reference
from lockstep.models.layers.rope import apply_rope, default_inv_freq, rope_cos_sin
from compiled_op import compile_op

pytestmark = pytest.mark.skipif(oa.triton is None, reason="Triton is not installed")
BF16_ULP = 2.0**-7


def _inputs(M, H, D, rope, seed):
    """o [M, H, D] bf16 and the cos / sin of M positions (0, 1 and far ones)."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(M, H, D, generator=g).bfloat16()
    positions = torch.cat([torch.tensor([0, 1]), torch.randint(0, 60_000, (M - 2,), generator=g)])
    cos, sin = rope_cos_sin(default_inv_freq(rope, 10_000.0), positions)
    return o.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)


def _derope(o, cos, sin):
    return apply_rope(o, cos.unsqueeze(-2), -sin.unsqueeze(-2))


@pytest.mark.parametrize("D,rope,block_k", [(128, 64, 0), (128, 128, 0), (128, 64, 256)])
def test_the_rotation_back_is_apply_ropes(D, rope, block_k):
    """With one-hot weights (row n reads input n) the kernel's output is its rotated input:
    apply_rope's bf16 values, bit for bit (on a GPU an fma may round a product and an add once, so
    there within a bf16 ulp, rarely); also with a K step across two heads (block_k 256)."""
    M, H, G = 20, 4, 2
    o, cos, sin = _inputs(M, H, D, rope, D + rope)
    K = H * D // G
    weight = torch.eye(K).repeat(G, 1).bfloat16().to(DEVICE)  # [G K, K]: group g's row n reads input n
    got = oa.derope_output_a(o, cos, sin, weight, G, block_k=block_k).reshape(M, H, D)
    want = _derope(o, cos, sin)
    diff = (got.float() - want.float()).abs()
    assert (diff <= BF16_ULP * want.float().abs()).all()
    assert (diff == 0).float().mean() > 0.99 if DEVICE == "cuda" else torch.equal(got, want)
    assert torch.equal(got[..., : D - rope], o[..., : D - rope])  # the unrotated channels pass as they are


@pytest.mark.parametrize("setting", [{}, {"block_k": 256}, {"split_k": 2}], ids=["default", "k256", "split2"])
@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "fp8"])
def test_the_kernel_is_output_projection_a(packed, setting):
    """Against the torch form on a GroupedLinear (and its packed fp8 copy): the rotation, then the
    grouped GEMM, to bf16 rounding (the sums go in another order); group widths not a power of two;
    K steps of launch_config's 128 inputs or one of 256 (two heads, two fp8 scale columns), or K in
    two fp32 splits added after."""
    M, H, D, rope, G, N = 20, 8, 128, 64, 4, 160  # K = 256 a group: two steps
    o, cos, sin = _inputs(M, H, D, rope, 7)
    wo_a = GroupedLinear(H * D // G, G * N, G)
    with torch.no_grad():
        wo_a.weight.copy_(torch.randn(G * N, H * D // G, generator=torch.Generator().manual_seed(8)) * 0.05)
        wo_a.weight[:, 128:] *= 8  # each group's second fp8 scale column apart from its first
    wo_a = wo_a.to(DEVICE, torch.bfloat16)
    rotated = _derope(o, cos, sin).reshape(M, G, -1)
    if packed:
        wo_a = Fp8Linear.packing(wo_a)
        want = fp8_grouped_reference(rotated, wo_a.weight, wo_a.weight_scale, wo_a.scale_row, G)
        weights = (wo_a.weight.view(torch.uint8), G, wo_a.weight_scale, wo_a.scale_row)
    else:
        want = wo_a(rotated)
        weights = (wo_a.weight, G)
    got = oa.derope_output_a(o, cos, sin, *weights, **setting)
    assert got.shape == (M, G, N) and got.dtype == torch.bfloat16
    tol = 2 * BF16_ULP
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
    compiled = compile_op(oa.derope_output_a)
    assert torch.equal(compiled(o, cos, sin, *weights, **setting), got)


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "fp8"])
def test_a_decode_steps_output_takes_the_kernel(monkeypatch, packed):
    """DeepseekV4Attention._output_step: the kernel where `runs` says so (a decode step; wo_a a
    GroupedLinear or its packed form), the torch form otherwise; the same output to bf16 rounding."""
    cfg = tiny_config()
    torch.manual_seed(3)
    attn = DeepseekV4Attention(cfg, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    attn = attn.to(DEVICE, torch.bfloat16)
    if packed:
        attn.o_a_proj = Fp8Linear.packing(attn.o_a_proj)
    N, H, D = 6, cfg.num_attention_heads, cfg.head_dim
    o = torch.randn(N, 1, H, D, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEVICE)
    positions = torch.arange(N, device=DEVICE).view(N, 1) * 997
    cos, sin = rope_cos_sin(attn.inv_freq, positions)
    calls, kernel = [], oa.derope_output_a
    monkeypatch.setattr(oa, "derope_output_a", lambda *a: calls.append(a) or kernel(*a))
    with torch.no_grad():
        want = attn._output(o, cos, sin)
        assert oa.runs(o, True) == (DEVICE == "cuda") and not calls  # a CPU tensor: the torch form
        monkeypatch.setattr(oa, "runs", lambda o, enabled: enabled and o.shape[1] == 1)
        got = attn._output_step(o, cos, sin)
        assert len(calls) == 1
        tol = 4 * BF16_ULP
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
        o2 = o.expand(N, 2, H, D).contiguous()  # not a decode step
        attn._output_step(o2, *rope_cos_sin(attn.inv_freq, positions.expand(N, 2)))
        assert len(calls) == 1
