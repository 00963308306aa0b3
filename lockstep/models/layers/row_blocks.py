"""Row blocks: the true-on-policy forward's way to make a token's arithmetic independent of its batch.

A GEMM or a reduction library kernel picks its tiling (and with it the order of its sums) from
the shapes it is called with: cuBLAS by M, torch's reduction kernels by the number of outputs,
oneDNN by its blocking. A row's result is still a pure function of that row once the call's
shape is fixed, because rows of one call never mix (every output element is its own sum). So
`row_blocks(fn, *xs)` calls `fn` on consecutive blocks of exactly ROWS rows (dim 0), the last
block zero-padded, and concatenates the results: whether a token is one of 64 decode rows, of a
prefill chunk or of a 16k-token training batch, every op inside `fn` sees the same shapes, so
the token gets the same bits. The padding rows compute garbage that no real row reads.

ROWS is one number for the engine and the trainer (a block size is part of the numerics: two
sides with different ROWS disagree). 64 rows fill a decode batch of 64 exactly and keep a
training batch's loop at T / 64 calls.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

import torch

ROWS = 64

_IN_ROWS_FORWARD: ContextVar[bool] = ContextVar("in_rows_forward", default=False)


@contextmanager
def rows_forward():
    """Marks a decoder layer's true-on-policy forward (deepseek_v4_rows.layer_rows): the modules it calls
    (the MoE, its experts, the compressors) then take their row-block paths. A property of the call, not
    of the module: the trainer runs the same modules through the default forward for its gradient."""
    token = _IN_ROWS_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_ROWS_FORWARD.reset(token)


def in_rows_forward() -> bool:
    # the row-block forward never runs compiled; asked first, so that a compiled default layer does not
    # trace the ContextVar (dynamo breaks the graph there: 28 graphs instead of 4 for the tiny model)
    return not torch.compiler.is_compiling() and _IN_ROWS_FORWARD.get()


def _block(x: torch.Tensor | None, start: int, rows: int) -> torch.Tensor | None:
    """Rows [start, start + rows) of x, zero-padded past its end (only the last block is copied)."""
    if x is None:
        return None
    block = x[start:start + rows]
    if block.shape[0] == rows:
        return block
    return torch.cat([block, block.new_zeros(rows - block.shape[0], *block.shape[1:])])


def _concat(outs: list, total: int):
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)[:total]
    if first is None:
        return None
    return type(first)(_concat([o[i] for o in outs], total) for i in range(len(first)))


def _store(out, y, start: int, n: int, total: int):
    """Write block result y's first n rows at `start` of out (allocated [total, ...] from y at the first
    block): without autograd the blocks stream into one output, never all held besides it."""
    if y is None:
        return None
    if isinstance(y, torch.Tensor):
        if out is None:
            out = y.new_empty(total, *y.shape[1:])
        out[start:start + n] = y[:n]
        return out
    out = out if out is not None else [None] * len(y)
    return type(y)(_store(o, part, start, n, total) for o, part in zip(out, y))


def row_blocks(fn: Callable, *xs: torch.Tensor, rows: int = ROWS):
    """fn(*blocks) over ROWS-row blocks of xs (all with the same dim 0; a None passes as None),
    results (a tensor, or a tuple of tensors / None) concatenated back to xs' row count."""
    total = xs[0].shape[0]
    starts = range(0, max(total, 1), rows)  # an empty input still runs one block: shapes to return
    if torch.is_grad_enabled():  # autograd: concatenate (a write into slices would copy the gradient per block)
        return _concat([fn(*(_block(x, i, rows) for x in xs)) for i in starts], total)
    out = None
    for i in starts:
        out = _store(out, fn(*(_block(x, i, rows) for x in xs)), i, max(min(rows, total - i), 0), total)
    return out
