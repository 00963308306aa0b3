"""The whole-rows slot pooling (pool_slots_triton.py) against Compressor.pool_slots, its torch
reference, and bitwise row invariance: an entry's pooled channels do not depend on how many entries
share the launch. Under Triton's interpreter here (TRITON_INTERPRET=1, conftest.py);
LOCKSTEP_TEST_DEVICE=cuda runs them on a GPU."""


import pytest
import torch

from lockstep.models.layers import pool_slots_triton as pst
from lockstep.models.layers.compressor import Compressor
from devices import DEVICE

needs_triton = pytest.mark.skipif(pst.triton is None, reason="triton is not installed")


def _case(seed, R, slots, D, dtype):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(R, slots, D, generator=g).to(dtype)
    gate = torch.randn(R, slots, D, generator=g) * 3
    gate[:, : slots // 2, :3] = float("-inf")  # C4's slots before block 0: weight 0
    return kv.to(DEVICE), gate.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots, D", [(8, 16), (6, 70), (128, 64)])  # C4 2m, slots not a power of two over
def test_equals_the_torch_reference(dtype, slots, D):                 # two channel blocks, C128's m
    kv, gate = _case(0, 5, slots, D, dtype)
    out = pst.pool_slots(kv, gate)
    ref = Compressor.pool_slots(kv, gate)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@needs_triton
def test_an_entrys_pooling_does_not_depend_on_the_others():
    kv, gate = _case(1, 9, 8, 70, torch.bfloat16)
    batch = pst.pool_slots(kv, gate)
    for r in (0, 4, 8):
        assert torch.equal(pst.pool_slots(kv[r:r + 1], gate[r:r + 1]), batch[r:r + 1])


def test_available_only_where_the_kernel_runs():
    kv = torch.zeros(2, 8, 16, device=DEVICE)
    if pst.triton is None:
        assert not pst.available(kv)
        return
    assert pst.available(kv) == (DEVICE == "cuda" or pst._gt.interpreted())
    assert not pst.available(kv.half())
