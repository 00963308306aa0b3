"""A decode step's dispatch order as one Triton kernel (dispatch_order_triton.py): the stable sort
by expert and the counts, the same integers as moe.dispatch_order. The kernel runs under Triton's
interpreter here (TRITON_INTERPRET=1, conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs it on a GPU."""

import os

import pytest
import torch

from lockstep.models.layers import dispatch_order_triton as dt
from lockstep.models.layers import grouped_gemm_triton as gt
from lockstep.models.layers import moe, moe_combine_triton
from lockstep.models.layers.grouped_gemm import group_offsets
from compiled_op import compile_op

needs_triton = pytest.mark.skipif(dt.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"


@needs_triton
# one slot; fewer slots than a program's block; a decode step of the 1b config (64 x 6 of 64
# experts); a block boundary inside a run of equal experts; experts not a power of two; many slots
@pytest.mark.parametrize("slots,experts", [(1, 4), (12, 3), (384, 64), (130, 40), (1536, 256)])
def test_the_kernel_is_the_stable_sort(slots, experts):
    flat = torch.randint(0, experts, (slots,), generator=torch.Generator().manual_seed(slots))
    flat[: slots // 3] = flat[0]  # many ties: stability matters
    order, counts = dt.dispatch_order_step(flat.to(DEVICE), experts)
    assert order.dtype == torch.long and counts.dtype == torch.long
    assert torch.equal(order.cpu(), torch.argsort(flat, stable=True))
    assert torch.equal(counts.cpu(), torch.bincount(flat, minlength=experts))
    ref_order, ref_counts = moe.dispatch_order(flat, experts, counting=True)
    assert torch.equal(order.cpu(), ref_order) and torch.equal(counts.cpu(), ref_counts)


@needs_triton
# a decode step of the 1b config (64 tokens x 6 of 64 experts), also 16 slots a program; tokens fewer
# than the shared groups; a block boundary inside a run of equal experts
@pytest.mark.parametrize("T,k,experts,block", [(64, 6, 64, 0), (64, 6, 64, 16), (3, 2, 5, 0), (65, 2, 40, 0)])
@pytest.mark.parametrize("shared_groups", [0, gt.SHARED_GROUPS])
def test_decode_dispatch_is_the_torch_ops_integers(T, k, experts, block, shared_groups):
    """decode_dispatch: the gather's rows (order // k, then the tokens for the shared expert), the
    group offsets (cumulative counts, then with_shared_groups') and the combine's slot rows."""
    flat = torch.randint(0, experts, (T * k,), generator=torch.Generator().manual_seed(T))
    flat[: T * k // 3] = flat[0]
    rows, offs, slot_rows = dt.decode_dispatch(flat.to(DEVICE), experts, k, shared_groups, block)
    order, counts = moe.dispatch_order(flat, experts)
    ref_offs = group_offsets(counts)
    ref_rows = order // k
    if shared_groups:
        ref_offs = gt.with_shared_groups(ref_offs, T)
        ref_rows = torch.cat([ref_rows, torch.arange(T)])
    assert rows.dtype == torch.long and offs.dtype == torch.int32 and slot_rows.dtype == torch.long
    assert torch.equal(rows.cpu(), ref_rows) and torch.equal(offs.cpu(), ref_offs)
    assert torch.equal(slot_rows.cpu(), moe_combine_triton.slot_rows(order, T, k))


def test_dispatch_order_takes_the_kernel_only_where_it_runs(monkeypatch):
    """moe.dispatch_order counts through the kernel where `runs` says so (CUDA, ENABLED, a bounded
    slot count), never when asked to sort; `runs` refuses CPU tensors and too many slots."""
    flat = torch.tensor([2, 0, 1, 0])
    assert not dt.runs(flat)  # CPU
    monkeypatch.setattr(dt, "runs", lambda f: True)
    seen = []
    monkeypatch.setattr(dt, "dispatch_order_step", lambda f, e: seen.append(e) or (f, f))
    moe.dispatch_order(flat, 3, counting=True)
    moe.dispatch_order(flat, 3, counting=False)
    assert seen == [3]


def test_runs_bounds_the_slots(monkeypatch):
    monkeypatch.setattr(dt, "ENABLED", True)
    meta = torch.empty(dt.MAX_SLOTS + 1, dtype=torch.long, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert dt.runs(meta[: dt.MAX_SLOTS]) == (dt.triton is not None) and not dt.runs(meta)
    assert not dt.runs(meta[:8].float().long().view(2, 4))


@needs_triton
def test_compiled_callers_get_the_kernels_result():
    flat = torch.randint(0, 64, (384,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    compiled = compile_op(dt.dispatch_order_step, dynamic=True)
    for a, b in zip(compiled(flat, 64), dt.dispatch_order_step(flat, 64)):
        assert torch.equal(a, b)
