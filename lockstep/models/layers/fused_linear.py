"""Projections that read the same input, run as one GEMM (the engine's fused weights).

A decode step multiplies each layer's input by up to seven small matrices (DeepSeek-V4's
attention: q_a, kv, the compressor's kv and gate, the indexer's kv, gate and head weights; the
MoE: shared gate and up; its router computes in fp32, moe.py). At a few dozen rows each product is one latency-bound kernel
of ~4 us on a GPU; stacked into one [sum(out), in] matrix they are one kernel.

`fuse_linears(owner, linears)` stores the weights as row blocks of one buffer, the owner's
non-persistent `fused_weight` (state dict names and contents are unchanged), and makes every
linear's weight a view of its block: a weight update that writes a linear's weight in place
(Engine.update_weights) writes the fused matrix too, so there is nothing to rebuild.
`project(owner, linears, x)` returns the outputs in order, through the fused matrix when there is
one. Unfused (the trainer), one GEMM per weight: the same values up to the GEMM's summation order.
"Linears" are modules with a bias-free `weight` [out, in] (nn.Linear); the weight
is read through the attribute, so a trainer's parametrisation (quant_aware.py) applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def is_fused(owner: nn.Module, linears: list[nn.Module]) -> bool:
    """Every linear's weight is still its block of the owner's fused matrix (a weight whose
    storage was replaced, e.g. by `module.to(dtype)`, is not: its updates would miss the matrix)."""
    fused = getattr(owner, "fused_weight", None)
    if fused is None:
        return False
    row = 0
    for lin in linears:
        if row >= fused.shape[0] or lin.weight.data_ptr() != fused[row].data_ptr():
            return False
        row += lin.weight.shape[0]
    return row == fused.shape[0]


def fuse_linears(owner: nn.Module, linears: list[nn.Module]) -> None:
    """(Re)build the owner's fused matrix from the linears' current weights; nothing to do when
    they are still its views."""
    if not linears or is_fused(owner, linears):
        return
    if any(getattr(lin, "bias", None) is not None for lin in linears):
        raise ValueError(f"{type(owner).__name__}: fused projections take bias-free linears")
    fused = torch.cat([lin.weight.detach() for lin in linears])
    owner.register_buffer("fused_weight", fused, persistent=False)
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[row:row + rows]
        row += rows


def project(owner: nn.Module, linears: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    fused = getattr(owner, "fused_weight", None)
    if fused is None:
        return [F.linear(x, lin.weight) for lin in linears]
    return list(F.linear(x, fused).split([lin.weight.shape[0] for lin in linears], dim=-1))
