"""Split-K partial sums added in a fixed order, as the Triton custom op `lockstep::sum_splits_in_order`
(issue 16): the second stage of every fixed-split-K kernel (hc_projection_triton.py's mHC mixes,
fixed_order_linear.py's GEMM at decode).

    out[i] = (((p[0, i] + p[1, i]) + p[2, i]) + ...) + p[S - 1, i]      (fp32, optionally rounded)

Why a kernel: torch's sum over the split dim picks its own split of the summed dim by the number of
outputs, so an element's bits would depend on the batch; here each element's S terms are added first
to last whatever the other elements or their count. `out_bf16` rounds the fp32 sum to bf16 once
(nearest even), in the same kernel (a separate cast was one more kernel per GEMM).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl

SUM_BLOCK = 256  # elements per program (any value: the order is per element)


if triton is not None:
    _bf16 = _gt._bf16  # by name: torch.compile's compile worker cannot resolve a module alias

    @triton.jit
    def _sum_splits_kernel(p_ptr, out_ptr, S, N, ROUND: tl.constexpr, INTERPRETED: tl.constexpr,
                           BLOCK: tl.constexpr):
        """out[i] = p[0, i] + p[1, i] + ... + p[S - 1, i], added in that order (fp32; ROUND: to bf16)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < N
        acc = tl.load(p_ptr + i, mask=ok, other=0.0)
        for s in range(1, S):
            acc += tl.load(p_ptr + s * N + i, mask=ok, other=0.0)
        if ROUND:
            tl.store(out_ptr + i, _bf16(acc, INTERPRETED), mask=ok)
        else:
            tl.store(out_ptr + i, acc, mask=ok)

    def launch_sum_splits(partials: torch.Tensor, out_bf16: bool) -> torch.Tensor:
        """The kernel's launch, for this op and for the ops whose second stage it is inside them
        (output_a_triton.py): partials [S, ...] fp32, contiguous."""
        out = partials.new_empty(partials.shape[1:], dtype=torch.bfloat16 if out_bf16 else torch.float32)
        n = out.numel()
        if n:
            torch.library.wrap_triton(_sum_splits_kernel)[(triton.cdiv(n, SUM_BLOCK),)](
                partials, out, partials.shape[0], n, ROUND=out_bf16, INTERPRETED=_gt.interpreted(), BLOCK=SUM_BLOCK)
        return out

    @torch.library.triton_op("lockstep::sum_splits_in_order", mutates_args=())
    def sum_splits_in_order(partials: torch.Tensor, out_bf16: bool = False) -> torch.Tensor:
        """partials [S, ...] fp32 -> [...] fp32 (out_bf16: bf16), each element's S terms added first
        to last."""
        return launch_sum_splits(partials.contiguous(), out_bf16)

    # shapes for torch.compile's tracing, written out (grouped_gemm_triton.py says why)
    @sum_splits_in_order.register_fake
    def _(partials, out_bf16=False):
        return partials.new_empty(partials.shape[1:], dtype=torch.bfloat16 if out_bf16 else torch.float32)
