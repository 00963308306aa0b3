"""The whole-rows forward's row-local steps, compiled (KernelSwitches.compile_rows; issue 16: the
true-on-policy forward at the compiled default's speed).

Why: over whole rows (whole_rows.py) a decode step of the 1b config is ~2,800 kernels of 2.7 us
mean on an H200, as many as the eager default's; the compiled default fuses its element-wise ops
into ~645, which is most of its 3x lead (true-on-policy rollout 0.32x of the compiled default,
0.98x of the eager one). Here each row-local step (mHC collapse + norm, the attention's
projections and output, the compressed entries' pooling, norm and RoPE, the MoE's routing, experts
and combine, mHC combine, the head's collapse + norm) is one torch.compile'd function, its
fixed-order kernels opaque custom ops inside, its element-wise ops fused between them. An engine
decode step's window keys and ring write (window_ring.window_keys, write_window) and compressor
block layout and state writes (compressor._step_blocks, _write_state) compile too: data movement
and integer arithmetic, the same values compiled or not, so the trainer need not share them.

Why the bits still agree: the engine's steps and the trainer's exact forward call the same
compiled function per step kind (one per function and layer kind, dynamic row count), so a row's
element-wise arithmetic is the same generated code whatever the row count; the reductions are the
fixed-order kernels'. A row count of 1, which inductor compiles as a graph of its own (its fusion
choices decide FMA contractions), is padded to 2 (`call_rows`); the decode-step bookkeeping
(`decode_call`) may take it: moves and integer arithmetic, and one add, round the same in any graph.

Checked on an H200 (1b config, every step above compiled): the CUDA equality tests
(tests/test_true_on_policy.py, bf16 / fp8 / fp8-fp4 across weight pushes) and logprob_gap
--true-on-policy 1 in bf16 and fp8 (exact 1.000, mean 0) pass; rollout 0.89x of the compiled
default (eager rows: 0.32x), 758 kernels per decode step against the default's 638. On by default on
CUDA (KernelSwitches.compile_rows).

A step is traced inside whole_rows() (CallMode: the mode is frozen into the graph), only through
`call`. Backend: inductor on CUDA, "eager" elsewhere (dynamo's trace without code generation: what
the CPU tests check).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils import _pytree as pytree

from .row_blocks import CallMode

# Entered by the true-on-policy layer (deepseek_v4_rows.py) when its compile_rows switch is on:
# whole_rows.row_local then calls the step's compiled form.
_COMPILED_ROWS = CallMode("compiled_rows")
compiled_rows, in_compiled_rows = _COMPILED_ROWS, _COMPILED_ROWS.on

# Dynamo keeps `recompile_limit` compilations per function (8 by default). Every step compiles
# through the one function `_whole_rows_step` (below): 7 steps x layer kinds x a row count of 1 or
# more, per dtype.
RECOMPILE_LIMIT = 256

_compiled: dict = {}


def _whole_rows_step(fn, *args):
    """The compiled frame of every whole-rows step. A function of this module, never compiled by the
    default path: dynamo caches compilations per frame's code, and the whole-rows mode is frozen into
    a graph without a guard (row_blocks.CallMode), so compiling `fn` itself (hc_combine, which the
    default path's compiled layers also run) could share a cache entry traced in the other mode."""
    return fn(*args)


def trace_settings():
    """No duck shaping (a row count that equals a weight dimension at the first call would be
    specialised to it), floats as constants (a symbolic float is specialised again by a later pass,
    restarting the trace)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.fx.experimental._config.patch(use_duck_shape=False))
    stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
    return stack


def mark_rows_dynamic(args) -> None:
    """The row dim (dim 0 of every tensor argument) dynamic from the first compilation, and only it.
    Compiled with dynamic=True, the hidden dims were symbols too: Triton could not prove them (the
    strides of a row) multiples of 16, so the fixed-order kernels and inductor's own lost their
    vector loads (in a decode step on an H200 the GEMMs reading a step's input took 3-4x their time
    alone; pytorch/pytorch#177061 reports 1.5-3.4x for inductor's kernels). One graph for every row
    count of 2 or more, as before: a row's code does not depend on the count."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim():
            torch._dynamo.maybe_mark_dynamic(a, 0)


def backend(on_cuda: bool):
    """inductor on CUDA; elsewhere dynamo's trace without code generation ("eager")."""
    return "inductor" if on_cuda else "eager"


def call(fn, *args):
    """fn(*args) compiled (fn: a module-level function, so that every layer of a kind shares one
    compilation; its module arguments' parameters are graph inputs, static). One graph per step:
    fullgraph."""
    on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    if on_cuda not in _compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # eager's bf16 roundings, as the default engine's compiled layers (compiled_layers.py): both
        # sides run this code, so it is not needed for their agreement, only to stay near eager
        options = {"emulate_precision_casts": True} if on_cuda else None
        # dynamic=False: no automatic dynamic shapes, which would turn any dim that differs between two
        # calls of the one frame (another step's hidden size) into a symbol; the rows only, marked
        _compiled[on_cuda] = torch.compile(_whole_rows_step, dynamic=False, fullgraph=True, backend=backend(on_cuda),
                                           options=options)
    mark_rows_dynamic(args)
    with trace_settings():
        return _compiled[on_cuda](fn, *args)


def call_rows(fn, owner, *xs):
    """fn(*xs), or fn(owner, *xs), compiled (`call`), where every x is rows (dim 0) or None, and so is
    every output. One row is padded to two (the row repeated; the first output row kept): inductor
    compiles a row count of 1 as a graph of its own, whose fusion choices (FMA contractions) could
    round a row otherwise than the graph every other count shares, and one-row calls happen (a
    training micro-batch of one short sequence closes a single HCA entry)."""
    one = isinstance(xs[0], torch.Tensor) and xs[0].shape[0] == 1
    if one:
        xs = tuple(x if x is None else torch.cat([x, x]) for x in xs)
    out = call(fn, *xs) if owner is None else call(fn, owner, *xs)
    if not one:
        return out
    return pytree.tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) else t, out)


def decode_call(new_tokens: int, fn, *args):
    """fn(*args) of an engine step's bookkeeping (data movement and integer arithmetic: the same values
    compiled or not): compiled for a decode step (one new token per sequence) inside compiled_rows(),
    else eager; prefill chunks of every length would each compile a graph."""
    if new_tokens == 1 and in_compiled_rows():
        return call(fn, *args)
    return fn(*args)
