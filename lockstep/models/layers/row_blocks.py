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

On CUDA that loop is launch-bound: a decoder layer's blocks are ~500 small ops each (1b config),
~7 ms of host time per layer and block on an H200 against well under a millisecond of kernels.
So without autograd, from GRAPH_MIN_BLOCKS blocks on, the first block runs eagerly (it warms up
cuBLAS and compiles Triton kernels), `fn` is captured once as a CUDA graph over static input
buffers, and every further block is a copy into those buffers and a replay. The captured kernels
are the eager ones with the same shapes, so the bits do not change (the engine's decode graphs
rely on the same fact). LOCKSTEP_ROW_GRAPHS=0 keeps the eager loop (to compare).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

import torch

ROWS = 64
GRAPH_MIN_BLOCKS = 4  # the first block and the capture cost about two eager blocks


class CallMode:
    """A flag that is a property of a call, not of a module (`with mode():` sets it for the calls
    made inside): the trainer runs the same modules through the default forward for its gradient.
    Inside a compiled region it is the value the region was traced under, frozen into its graph
    without a guard (dynamo cannot read a ContextVar: a graph break, 28 graphs instead of 4 for the
    tiny model, or "Unsupported method call" under fullgraph). So a compiled function is traced and
    called in one mode only: the default path's compiled layers outside these modes, the whole-rows
    steps (compiled_rows.py) inside whole_rows() only, each its own function and cache."""

    def __init__(self, name: str):
        self._var: ContextVar[bool] = ContextVar(name, default=False)
        # built at the first entry, not at import: it imports torch._dynamo, ~2.5 s of a process
        # start on a 2-core machine, which a run that never enters the mode does not need
        self._at_trace = None

    @contextmanager
    def __call__(self):
        if self._at_trace is None:
            var = self._var  # a plain function: assume_constant_result does not take a builtin method
            self._at_trace = torch._dynamo.assume_constant_result(lambda: var.get())
        token = self._var.set(True)
        try:
            yield
        finally:
            self._var.reset(token)

    def on(self) -> bool:
        if torch.compiler.is_compiling():
            # never entered in this process, so off: the constant the hook would have given
            return False if self._at_trace is None else self._at_trace()
        return self._var.get()


# A decoder layer's true-on-policy forward (deepseek_v4_rows.layer_rows): the modules it calls (the
# MoE, its experts, the compressors) then take their row-block paths.
_ROWS_FORWARD = CallMode("rows_forward")
rows_forward, in_rows_forward = _ROWS_FORWARD, _ROWS_FORWARD.on


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
    if _replays(xs[0], len(starts)):
        return _graph_blocks(fn, xs, starts, rows, total)
    out = None
    for i in starts:
        out = _store(out, fn(*(_block(x, i, rows) for x in xs)), i, max(min(rows, total - i), 0), total)
    return out


def _replays(x: torch.Tensor, blocks: int) -> bool:
    """Whether the blocks go through one captured CUDA graph: CUDA, enough blocks, not already inside a
    capture (the engine's decode graphs call the row blocks too), not switched off."""
    return (x.is_cuda and blocks >= GRAPH_MIN_BLOCKS and not torch.cuda.is_current_stream_capturing()
            and os.environ.get("LOCKSTEP_ROW_GRAPHS", "1") != "0")


def _fill(static: torch.Tensor | None, x: torch.Tensor | None, start: int, rows: int) -> None:
    """Copy rows [start, start + rows) of x into the static buffer, zeros past x's end (as _block pads)."""
    if static is None:
        return
    n = max(min(rows, x.shape[0] - start), 0)
    static[:n].copy_(x[start:start + n])
    static[n:].zero_()


def _graph_blocks(fn: Callable, xs, starts: range, rows: int, total: int):
    """The eager loop's results, blocks after the first replayed from one CUDA graph of `fn`."""
    # empty_like keeps a block's strides: the captured kernels see the layouts the eager ones do
    static = [None if x is None else torch.empty_like(_block(x, 0, rows)) for x in xs]
    for s, x in zip(static, xs):
        _fill(s, x, 0, rows)
    out = _store(None, fn(*static), 0, min(rows, total), total)  # eager: lazy initialisation before capture
    graph, ys = _capture(fn, static)
    for i in starts[1:]:
        for s, x in zip(static, xs):
            _fill(s, x, i, rows)
        graph.replay()
        out = _store(out, ys, i, min(rows, total - i), total)
    return out


def _capture(fn: Callable, static: list):
    """fn(*static) captured as a CUDA graph -> (graph, its outputs). Not `torch.cuda.graph`: that
    synchronises and empties the allocator's cache on entry, per call here (several per layer)."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the static inputs' copies
    with torch.cuda.stream(stream):
        # thread_local: the engine's other threads may use CUDA meanwhile
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            ys = fn(*static)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, ys
