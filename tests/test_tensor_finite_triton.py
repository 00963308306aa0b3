"""tensor_finite_triton.nonfinite_flags: which tensors hold a NaN or an inf, in one launch, exact
where a norm would overflow (under TRITON_INTERPRET=1 on the CPU, tests/conftest.py; compiled with
LOCKSTEP_TEST_DEVICE=cuda). The weight update's check with it: tests/engine/test_weight_update.py."""

import warnings

import pytest
import torch

pytest.importorskip("triton")

from lockstep import tensor_finite_triton as tf  # noqa: E402
from devices import DEVICE
from launches import count_launches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_flags_name_exactly_the_tensors_holding_nan_or_inf(monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    sizes = [1000, 3 * tf.CHUNK + 7, 33, tf.CHUNK, 0, 5]
    tensors = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    tensors[1][-1] = float("nan")  # in the last, partial chunk
    tensors[2][0] = float("-inf")
    tensors[5][4] = float("inf")
    tensors[3][:] = 6e4 if dtype == torch.float16 else 1e30 if dtype == torch.float32 else 1e38  # finite, huge
    tensors = [t.to(DEVICE) for t in tensors]
    assert torch.isinf(torch.stack(torch._foreach_norm([tensors[3]]))).all()  # where a norm overflows
    launches = count_launches(monkeypatch, tf, "_nonfinite_kernel")
    assert tf.checkable(tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy on inf - inf
        flags = tf.nonfinite_flags(tensors).tolist()
        assert flags == [0, 1, 1, 0, 0, 1] and len(launches) == 2  # sizes of a multiple of 16 values, the rest
        tensors[1][-1] = 0.0  # the same tensors again (the kept launch), the flags zeroed anew
        assert tf.nonfinite_flags(tensors).tolist() == [0, 0, 1, 0, 0, 1]


def test_what_it_cannot_read_is_refused():
    a = torch.zeros(4, 4, device=DEVICE)
    assert not tf.checkable([a, a.to(torch.bfloat16)])  # two dtypes: one launch each, by the caller
    assert not tf.checkable([a.t()])  # not contiguous
    assert not tf.checkable([torch.zeros(3, dtype=torch.int64, device=DEVICE)])
    assert not tf.checkable([])


def test_the_launch_is_prepared_once_for_the_same_tensors():
    tensors = [torch.ones(10, device=DEVICE), torch.ones(3, device=DEVICE)]
    tf._PREPARED._entries.clear()
    for _ in range(3):
        assert tf.nonfinite_flags(tensors).tolist() == [0, 0]
    assert len(tf._PREPARED._entries) == 1


def test_the_gate_is_closed_by_any_tensor_holding_nan_or_inf():
    tensors = [torch.ones(40, device=DEVICE), torch.ones(tf.CHUNK + 3, device=DEVICE)]
    gate = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert tf.nonfinite_flags(tensors, gate=gate).tolist() == [0, 0] and gate.item() == 0
    tensors[1][-1] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy on inf - inf
        assert tf.nonfinite_flags(tensors, gate=gate).tolist() == [0, 1] and gate.item() == 1
