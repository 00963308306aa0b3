import torch

from lockstep.quant import (
    dequantize_fp4_block,
    dequantize_fp8_block,
    fake_quant_fp4,
    fake_quant_fp8,
    quantize_fp4_block,
    quantize_fp8_block,
)


def test_fake_quant_fp8_forward_and_identity_gradient():
    torch.manual_seed(0)
    w = (torch.randn(130, 200) * 0.05).bfloat16().requires_grad_()
    y = fake_quant_fp8(w)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, dequantize_fp8_block(*quantize_fp8_block(w.detach()), torch.bfloat16))
    assert not torch.equal(y, w.detach())  # it does quantise
    g = torch.randn(130, 200).bfloat16()
    (y.float() * g.float()).sum().backward()
    assert torch.equal(w.grad, g)


def test_fake_quant_fp4_forward_and_identity_gradient():
    torch.manual_seed(1)
    w = torch.randn(4, 64, 96, requires_grad=True)
    y = fake_quant_fp4(w)
    assert y.dtype == torch.float32
    assert torch.equal(y, dequantize_fp4_block(*quantize_fp4_block(w.detach()), torch.float32))
    g = torch.randn_like(w)
    (y * g).sum().backward()
    assert torch.equal(w.grad, g)


def test_fake_quant_traces_into_one_graph():
    """The trainer's quantisation-aware forward runs inside compiled whole-rows steps (compiled_rows.py,
    fullgraph): the fake quantisers must trace without a graph break (the e8m0 scale check reads the
    host eagerly only) and give the eager values."""
    torch.manual_seed(2)
    w4, w8 = torch.randn(4, 64, 96), (torch.randn(130, 256) * 0.05).bfloat16()
    torch._dynamo.reset()
    traced = torch.compile(lambda a, b: (fake_quant_fp4(a), fake_quant_fp8(b)), fullgraph=True, backend="eager")
    y4, y8 = traced(w4, w8)
    assert torch.equal(y4, fake_quant_fp4(w4)) and torch.equal(y8, fake_quant_fp8(w8))
