"""lockstep/triton_support.py: the interpreter's unasserted overflow checks are off (its options), and
the kernels compute as before: integer arithmetic wraps as on the GPU."""

import pytest
import torch

from lockstep.models.layers import grouped_gemm_triton

triton = grouped_gemm_triton.triton
if triton is not None:
    import triton.language as tl

    @triton.jit
    def _wrapping_add(x_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i)
        tl.store(out_ptr + i, x * 2 + 1)  # int32: wraps past 2^31 (the check would have computed, not asserted)


@pytest.mark.skipif(triton is None or not grouped_gemm_triton.interpreted(),
                    reason="needs triton with TRITON_INTERPRET=1 (every CPU run sets it: tests/conftest.py)")
def test_the_interpreter_computes_no_overflow_checks_and_still_wraps():
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    assert options.sanitize_overflow is False and options.debug is False
    x = torch.tensor([1, 2**30 + 5, 2**31 - 1, -(2**31)], dtype=torch.int32)
    out = torch.empty_like(x)
    _wrapping_add[(1,)](x, out, BLOCK=4)
    assert out.tolist() == [3, -(2**31) + 11, -1, 1]
