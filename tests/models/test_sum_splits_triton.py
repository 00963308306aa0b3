"""The fixed-order split-K sum (sum_splits_triton.py): each element's splits added first to last,
the same bits whatever the other elements, optionally rounded to bf16 in the kernel. Under Triton's
interpreter here (TRITON_INTERPRET=1, conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs it on a GPU."""


import pytest
import torch

from lockstep.models.layers import sum_splits_triton as ss
from devices import DEVICE

needs_triton = pytest.mark.skipif(ss.triton is None, reason="triton is not installed")


def _partials(seed):
    # fp32 terms of wildly different sizes: the sum's bits depend on the order, so only the
    # left-to-right order matches; 300 x 7 elements: more than one program, a partial last one
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(32, 300, 7, generator=g) * 10.0 ** torch.randint(-6, 7, (32, 300, 7), generator=g)).to(DEVICE)


def _left_to_right(partials):
    total = partials[0]
    for term in partials[1:]:
        total = total + term
    return total


@needs_triton
def test_splits_are_added_first_to_last():
    partials = _partials(11)
    total = _left_to_right(partials)
    out = ss.sum_splits_in_order(partials)
    assert out.shape == (300, 7) and out.dtype == torch.float32 and torch.equal(out, total)
    assert not torch.equal(partials.flip(0).sum(0), total)  # the premise: the order shows in the bits
    assert torch.equal(ss.sum_splits_in_order(partials[:, 5:6]), total[5:6])  # alone, the same bits


@needs_triton
def test_the_bf16_sum_is_the_fp32_sum_rounded_once():
    partials = _partials(12)
    out = ss.sum_splits_in_order(partials, out_bf16=True)
    # torch's fp32 -> bf16 cast rounds to nearest even, as the kernel must (the interpreter's truncates)
    assert out.dtype == torch.bfloat16 and torch.equal(out, _left_to_right(partials).bfloat16())
    one = torch.tensor([[1.0 + 2**-8 + 2**-20]], device=DEVICE)  # just over a tie: rounds up
    assert ss.sum_splits_in_order(torch.stack([one, torch.zeros_like(one)]), out_bf16=True).item() == 1.0 + 2**-7
