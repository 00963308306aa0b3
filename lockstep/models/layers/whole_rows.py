"""Whole rows: the true-on-policy forward's row-local steps over every row in one call, with
kernels whose per-row result cannot depend on the row count (KernelSwitches.fixed_order; issue 16
item 2).

The row blocks (row_blocks.py) make a token's bits independent of its batch by calling library
kernels with one shape, 64 rows at a time: on a GPU ~500 small kernels per decoder layer and
block. The same guarantee holds for one call over all rows when every op in it is either
element-wise, a max (exact in any order), or a sum whose order is fixed by construction:
- RMSNorm: fixed_order_rmsnorm.py (one program per row, tiles walked in index order);
- GEMMs (the attention's projections, the router, the shared expert): `linear` here, i.e.
  fixed_order_linear.py (launch config by N and K only, K walked in order, a fixed split of K
  for narrow weights);
- mHC's projection: hc_projection_triton.py's partial products over splits of K (launch config
  by J and K only), the splits added first to last (sum_splits_triton.py). Not fixed_order_linear:
  unsplit, its 16-row tiles walked K = n * D alone, 4 programs for a decode step's 64
  rows (144 us per call on an H200, where the split-K kernel has 128 programs);
- sums over a handful of terms (mHC's n = 4 streams, its 4 x 4 softmax and Sinkhorn): written
  out left to right (`sum_in_order`), element-wise ops, so any row count adds in the same order;
  Sinkhorn on CUDA is already one Triton kernel per row (sinkhorn_triton.py, that order);
- element-wise ops: the same bits at any size, except torch's CPU sigmoid (`sigmoid_any_size` here).
Inside `whole_rows()` the shared modules (norm.py, hyper_connection.py, sinkhorn.py) take these
forms; deepseek_v4_rows.py enters it for the mHC + norm steps of a layer and the head's mHC,
where the kernels run (CUDA, or TRITON_INTERPRET=1 in the CPU tests), and for the MoE where the
routed experts take their row-invariant Triton kernels (moe.py: its GEMMs by `linear` here, top-k
by a stable sort, the weights' sum by `sum_in_order`). The attention runs over whole rows too
(attention_rows' `whole_rows` argument): its projections and output by `linear`, its core as one
kernel (tiled_attention_triton.py), the C4 layers' entry picks from another (index_scores_triton.py),
the compressors' pooling from a third (pool_slots_triton.py). The LM head is `linear` with fp32
output (deepseek_v4_rows.logits_rows).

On by default on CUDA (KernelSwitches.fixed_order). Measured on an H200 (1b config, both sides
eager): the CUDA equality tests pass with it; rollout 0.76x of the default's tokens/s (row blocks:
0.45-0.51x), a 4,096-token prefill 0.17 s (row blocks: 0.46-0.70 s), a training step 0.65x (0.23x).
On the CPU the row blocks stay (the kernels would run interpreted); the tests switch it on there.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from . import compiled_rows, fixed_order_linear
from .row_blocks import CallMode, row_blocks

# A call over every row at once: the modules it reaches take their fixed-order forms.
_WHOLE_ROWS = CallMode("whole_rows")
whole_rows, in_whole_rows = _WHOLE_ROWS, _WHOLE_ROWS.on


def kernels_run(x: torch.Tensor) -> bool:
    """Whether the fixed-order kernels run for activations like x (CUDA or the interpreter, no
    gradient): elsewhere their references are plain torch ops, whose order follows the row count."""
    return fixed_order_linear.runs_on(x) and not torch.is_grad_enabled()


def row_local(whole: bool, fn, *xs, owner=None):
    """fn(*xs), or fn(owner, *xs), over the rows of xs: in one call inside `whole_rows()` (whole: the
    caller checked `kernels_run` and its switch), through fn's compiled form where the caller
    entered compiled_rows() (compiled_rows.py; fn module-level), else in row blocks (row_blocks.py)."""
    args = xs if owner is None else (owner, *xs)
    if whole:
        with whole_rows():
            if compiled_rows.in_compiled_rows():
                return compiled_rows.call_rows(fn, owner, *xs)
            return fn(*args)
    return row_blocks(fn if owner is None else partial(fn, owner), *xs)


def linear(x: torch.Tensor, weight: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
    """F.linear(x, weight), bias-free (fp32_out: in fp32, as F.linear of the upcast inputs); over whole
    rows the fixed-order GEMM, or an error where it cannot run (a library GEMM there would tie a
    row's bits to the row count). A grouped weight [G, N, K] takes x [..., G, K] (whole rows only)."""
    if not in_whole_rows():
        return F.linear(x.float(), weight.float()) if fp32_out else F.linear(x, weight)
    if not fixed_order_linear.kernel_applies(x, weight):
        raise ValueError(f"whole rows: no fixed-order GEMM for x {x.dtype} {tuple(x.shape)} on {x.device} and weight "
                         f"{weight.dtype} {tuple(weight.shape)} (bf16 or fp32 alike, CUDA, no gradient)")
    return fixed_order_linear.fixed_order_linear(x, weight, fp32_out)


def apply_linear(module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for a bias-free linear module (nn.Linear, or a packed fp8 one serving the default
    path); over whole rows the fixed-order GEMM of its weight (`linear`)."""
    return linear(x, module.weight) if in_whole_rows() else module(x)


def sum_in_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over `dim` (a few terms) left to right, as element-wise adds."""
    terms = x.unbind(dim)
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def softmax_in_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax over a short `dim`: the max is exact in any order, the sum is sum_in_order."""
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / sum_in_order(e, dim).unsqueeze(dim)


def sigmoid_any_size(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)): torch's CPU sigmoid takes another code path for small tensors (other last
    bits for a decode step's few rows); exp and the division round the same at any size."""
    return 1 / (1 + torch.exp(-x))
