"""MoE dispatch order: the counting form (small batches, decode) is the stable argsort, exactly."""

import pytest
import torch

from lockstep.models.layers.moe import dispatch_order


@pytest.mark.parametrize("slots,experts", [(1, 4), (12, 3), (384, 64), (5000, 256)])
def test_dispatch_order_is_the_stable_sort(slots, experts):
    flat = torch.randint(0, experts, (slots,), generator=torch.Generator().manual_seed(slots))
    flat[: slots // 3] = flat[0]  # many ties: stability matters
    for counting in (True, False, None):  # the two forms, and the choice by size
        order, counts = dispatch_order(flat, experts, counting)
        assert torch.equal(order, torch.argsort(flat, stable=True))
        assert torch.equal(counts, torch.bincount(flat, minlength=experts))
