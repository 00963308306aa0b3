"""Tensors whose shape never changes, marked as such for torch.compile.

The compiled layers (models/compiled_layers.py) are compiled with dynamic=True, so that one graph
serves every batch size; but dynamic=True makes every dimension of every input a symbol, the rollout
cache's and the rotary frequencies' included, and dynamo's tracing then spends most of its time in
symbolic arithmetic over them. Measured on the 1b config's five decode graphs (CPU, backend eager):
bytecode tracing 18-24 s with every dimension a symbol, 6.5-10 s with none, 13-15 s with the marks
here (142 symbols -> 47). A cache is allocated once per engine and lives as long: its dimensions are
constants, and only the token dimensions of the layer's inputs stay symbols.

Precompiled regions (models/precompiled.py) need the marks only while they compile: a function
loaded from a file rebuilds its guards from tensors saved without their marks, so it refuses a
marked tensor ("_has_dynamo_dim_marking is present on runtime tensor but was absent at compile
time", torch 2.13), while a function compiled in this process takes an unmarked one. Every mark is
therefore also registered: `unmark(tensors)` takes the marks off, `marked(tensors)` puts the
registered ones back for the length of a compilation.

Marks wait for dynamo: loading it, with the inductor and Triton modules it pulls in, made a
single-process `lockstep train` run on 2 cores 16.7 s where it is 11.4 s without, and a process that
compiles nothing (the CPU default) never reads a mark. A tensor registered before dynamo is loaded is marked by `mark_registered()`, which
the dynamic-shape compilation calls when it is set up (compiled_layers.py); one registered after is
marked at once.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch

# id(tensor) -> (a weak reference to it, its fixed dims, whether it asked to be marked), of the live tensors only
_registry: dict[int, tuple[weakref.ref, tuple[int, ...], bool]] = {}
_marks_made = [0]  # how many marks were made so far: nothing to take off while it stands still


def fixed_shape(t: torch.Tensor | None, dims: range | None = None, mark: bool = True) -> torch.Tensor | None:
    """Mark dimensions `dims` (None: all) of `t` static for torch.compile (a no-op outside it); -> t.
    A mark belongs to the tensor object: a copy (`.to`, `.clone`) must be marked again.
    mark=False only registers the dims, for `marked` to mark them."""
    if t is not None:
        dims = tuple(range(t.dim()) if dims is None else dims)
        key = id(t)
        _registry[key] = (weakref.ref(t, lambda _, key=key: _registry.pop(key, None)), dims, mark)
        if mark and _dynamo_loaded():
            _mark(t, dims)
    return t


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


def mark_registered() -> None:
    """Mark every live registered tensor that asked to be marked (module docstring: loads dynamo)."""
    for ref, dims, wanted in list(_registry.values()):
        t = ref()
        if wanted and t is not None:
            _mark(t, dims)


def _mark(t: torch.Tensor, dims: tuple[int, ...]) -> None:
    for d in dims:
        torch._dynamo.mark_static(t, d)
    _marks_made[0] += 1


def marks_made() -> int:
    return _marks_made[0]


def unmark(tensors) -> None:
    """Take the marks off `tensors` (registered ones stay registered)."""
    for t in tensors:
        for name in ("_dynamo_static_indices", "_has_dynamo_dim_marking"):  # what mark_static sets
            if hasattr(t, name):
                delattr(t, name)


@contextlib.contextmanager
def marked(tensors):
    """The registered ones among `tensors` marked inside (for a compilation), unmarked after."""
    tensors = list(tensors)
    for t in tensors:
        entry = _registry.get(id(t))
        if entry is not None and entry[0]() is t:
            _mark(t, entry[1])
    try:
        yield
    finally:
        unmark(tensors)
