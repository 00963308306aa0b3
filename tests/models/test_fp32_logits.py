"""The LM head's fp32 logits from bf16 operands (layers/fp32_logits.py): its backward against the
fp32 autograd of the upcast GEMM. On the CPU the GEMMs are the upcast fp32 ones, so this checks the
Function's algebra and the bf16 rounding of the logits gradient; LOCKSTEP_TEST_DEVICE=cuda runs the
same on cuBLAS's bf16 GEMMs with fp32 output."""

from __future__ import annotations


import torch

from lockstep.models.layers.fp32_logits import Fp32Logits, fp32_logits
from devices import DEVICE



def _operands(T=48, H=64, V=200):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEVICE)
    weight = (torch.randn(V, H, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)
    return hidden.requires_grad_(), weight.requires_grad_()


def test_backward_matches_the_fp32_gemm_to_bf16_rounding():
    hidden, weight = _operands()
    target = torch.randint(0, weight.shape[0], (hidden.shape[0],), generator=torch.Generator().manual_seed(1))
    grads, values = [], []
    for head in (lambda h, w: torch.nn.functional.linear(h.float(), w.float()), Fp32Logits.apply):
        logits = head(hidden, weight)
        loss = torch.nn.functional.cross_entropy(logits, target.to(DEVICE))
        values.append(logits.detach())
        grads.append(torch.autograd.grad(loss, (hidden, weight)))
    assert values[1].dtype == torch.float32
    torch.testing.assert_close(values[1], values[0], rtol=1e-5, atol=1e-5)  # summation order only
    for ours, ref in zip(*grads):
        assert ours.dtype == ref.dtype == torch.bfloat16
        # the logits gradient rounded to bf16 (2^-9 relative) before the GEMMs: within a few bf16 ulps
        torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=1e-2 * ref.float().abs().max().item())


def test_fp32_logits_takes_the_function_only_where_it_applies():
    hidden, weight = _operands()
    with torch.no_grad():
        plain = fp32_logits(hidden, weight)
    out = fp32_logits(hidden.view(4, 12, -1), weight)
    assert out.shape == (4, 12, weight.shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out.detach().view_as(plain), plain, rtol=0, atol=0)
    expected = "Fp32LogitsBackward" if DEVICE == "cuda" else "MmBackward"
    assert expected in type(out.grad_fn.next_functions[0][0]).__name__ or expected in type(out.grad_fn).__name__
