"""Tensors whose shape never changes, marked as such for torch.compile.

The compiled layers (models/compiled_layers.py) are compiled with dynamic=True, so that one graph
serves every batch size; but dynamic=True makes every dimension of every input a symbol, the rollout
cache's and the rotary frequencies' included, and dynamo's tracing then spends most of its time in
symbolic arithmetic over them. Measured on the 1b config's five decode graphs (CPU, backend eager):
bytecode tracing 18-24 s with every dimension a symbol, 6.5-10 s with none, 13-15 s with the marks
here (142 symbols -> 47). A cache is allocated once per engine and lives as long: its dimensions are
constants, and only the token dimensions of the layer's inputs stay symbols.
"""

from __future__ import annotations

import torch


def fixed_shape(t: torch.Tensor | None, dims: range | None = None) -> torch.Tensor | None:
    """Mark dimensions `dims` (None: all) of `t` static for torch.compile (a no-op outside it); -> t.
    A mark belongs to the tensor object: a copy (`.to`, `.clone`) must be marked again."""
    if t is not None:
        for d in range(t.dim()) if dims is None else dims:
            torch._dynamo.mark_static(t, d)
    return t
