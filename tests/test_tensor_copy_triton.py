"""tensor_copy_triton.copy_many: many tensors copied in one launch, as bytes, equal to torch's copy
bit for bit (under TRITON_INTERPRET=1 on the CPU, tests/conftest.py; compiled with
LOCKSTEP_TEST_DEVICE=cuda), aligned or not. The weight update's write with it:
tests/engine/test_weight_update.py."""

import pytest
import torch

pytest.importorskip("triton")

from lockstep import tensor_copy_triton as tc  # noqa: E402
from devices import DEVICE
from launches import launch_arguments


def _sources():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1000, generator=g).to(torch.bfloat16),  # under one chunk
            torch.randn(3, 11_111, generator=g),  # 133,332 bytes: three chunks, the last partial
            torch.randint(-2**40, 2**40, (33,), generator=g),  # int64
            torch.randn(tc.CHUNK // 2, generator=g).to(torch.bfloat16),  # exactly one chunk
            torch.zeros(0, 5),  # empty: nothing launched for it
            torch.randn(7, 3, generator=g).to(torch.float16)]


def test_many_tensors_in_a_launch_per_alignment_bit_for_bit(monkeypatch):
    srcs = [s.to(DEVICE) for s in _sources()]
    dsts = [torch.full_like(s, 7) for s in srcs]
    launches = launch_arguments(monkeypatch, tc, "_copy_kernel")
    assert all(tc.copyable(d, s) for d, s in zip(dsts, srcs))
    tc.copy_many(dsts, srcs)
    assert len(launches) == 2  # the sizes of a multiple of 16 bytes, 16 bytes an access; the odd ones
    assert {c["ALIGN"] for _, c in launches} == {16, 1}
    for d, s in zip(dsts, srcs):
        assert torch.equal(d.view(torch.uint8) if d.numel() else d, s.view(torch.uint8) if s.numel() else s)
    srcs[1].mul_(2)  # the same tensors again: the kept launch, reading what they hold now
    tc.copy_many(dsts, srcs)
    assert len(launches) == 4 and torch.equal(dsts[1], srcs[1])


def test_unaligned_addresses_and_sizes_copy_exactly():
    base = torch.arange(200_003, dtype=torch.int64).to(torch.uint8).to(DEVICE)
    src, dst = base[1:150_001], torch.zeros(150_003, dtype=torch.uint8, device=DEVICE)[3:]  # odd addresses
    assert tc.alignment_groups([[src.data_ptr(), dst.data_ptr()]], [src.numel()]) == {1: [0]}
    tc.copy_many([dst], [src])
    assert torch.equal(dst, src)


def test_what_it_cannot_copy_is_refused():
    a = torch.zeros(4, 4, device=DEVICE)
    assert not tc.copyable(a, torch.zeros(4, 4, dtype=torch.bfloat16, device=DEVICE))  # a cast
    assert not tc.copyable(a, torch.zeros(4, 4, device=DEVICE).t())  # not contiguous
    assert not tc.copyable(a, torch.zeros(16, device=DEVICE))  # another shape


def test_a_closed_gate_writes_nothing_and_is_read_when_the_launch_runs():
    srcs = [s.to(DEVICE) for s in _sources()]
    dsts = [torch.full_like(s, 7) for s in srcs]
    gate = torch.ones(1, dtype=torch.int32, device=DEVICE)
    tc.copy_many(dsts, srcs, gate=gate)
    assert all(torch.equal(d, torch.full_like(d, 7)) for d in dsts)
    gate.zero_()  # the kept launch again: the gate's value when it runs decides
    tc.copy_many(dsts, srcs, gate=gate)
    assert all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in zip(dsts, srcs) if s.numel())
