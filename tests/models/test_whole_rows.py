"""The whole-rows forms (models/layers/whole_rows.py) outside the model: the GEMM helper takes the
fixed-order kernel inside `whole_rows()` and refuses what that kernel cannot run, and the router's
whole-rows selection is the top-k's set with ties to the lower expert. The kernels run under
Triton's interpreter here (TRITON_INTERPRET=1, conftest.py)."""

import pytest
import torch
import torch.nn.functional as F

from lockstep.models.layers import fixed_order_linear, moe
from lockstep.models.layers.whole_rows import linear, row_local, whole_rows

needs_triton = pytest.mark.skipif(fixed_order_linear.triton is None, reason="triton is not installed")


@needs_triton
def test_linear_takes_the_fixed_order_kernel_inside_whole_rows(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g).bfloat16(), torch.randn(24, 32, generator=g).bfloat16()
    calls = []
    kernel = fixed_order_linear.fixed_order_linear
    monkeypatch.setattr(fixed_order_linear, "fixed_order_linear", lambda *a: calls.append(a) or kernel(*a))
    assert torch.equal(linear(x, w), F.linear(x, w)) and not calls  # outside: the library GEMM
    with whole_rows():
        y = linear(x, w)
    assert len(calls) == 1 and torch.equal(y, kernel(x, w))
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), rtol=2**-7, atol=1e-2)


@needs_triton
def test_linear_refuses_what_the_kernel_cannot_run():
    x, w = torch.ones(3, 16).bfloat16(), torch.ones(8, 16)
    with whole_rows(), pytest.raises(ValueError, match=r"whole rows: no fixed-order GEMM for x torch.bfloat16"):
        linear(x, w)  # mixed dtypes: a library GEMM would tie a row's bits to the row count
    with whole_rows(), pytest.raises(ValueError, match="no fixed-order GEMM"):
        linear(x.double(), w.double())


def test_row_local_blocks_or_whole():
    seen = []
    x = torch.arange(130.0).unsqueeze(1)
    assert torch.equal(row_local(False, lambda t: seen.append(t.shape[0]) or t * 2, x), x * 2)
    assert seen == [64, 64, 64]  # row blocks: 64 rows each, the last one padded
    seen.clear()
    assert torch.equal(row_local(True, lambda t: seen.append(t.shape[0]) or t * 2, x), x * 2)
    assert seen == [130]


def test_whole_rows_top_k_is_the_sets_with_ties_to_the_lower_expert():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(50, 16, generator=g)
    scores[0, [3, 9, 12]] = 2.0  # a three-way tie for the first two places: experts 3 and 9 win
    with whole_rows():
        picked = moe._top_k(scores, 2)
    usual = moe._top_k(scores, 2)
    assert torch.equal(picked[0].sort().values, torch.tensor([3, 9]))
    assert torch.equal(picked[1:].sort(-1).values, usual[1:].sort(-1).values)  # no ties: topk's set
