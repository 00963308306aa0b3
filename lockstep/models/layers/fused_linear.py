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

Packed fp8 linears (fp8_linear.Fp8Linear, the engine serving fp8) are fused apart from the others:
their e4m3 bytes stack into the owner's `fused_fp8_weight`, their block-scale tables into
`fused_fp8_scale`, and `fused_fp8_scale_row` says which table row each output row reads, so every
weight keeps its own 128x128 blocks whatever its row count (no 128-row alignment needed). Such an
owner runs two GEMMs (DeepSeek-V4's attention: q_a and kv in fp8, the compressors' and indexer's
bf16 projections; the shared expert's gate and up: one fp8 GEMM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_linear import Fp8Linear, fp8_linear
from .whole_rows import linear


def _split(linears: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
    """(plain linears, packed fp8 ones), each in the given order."""
    return ([lin for lin in linears if not isinstance(lin, Fp8Linear)],
            [lin for lin in linears if isinstance(lin, Fp8Linear)])


def _stacked(fused: torch.Tensor | None, parts: list[torch.Tensor]) -> bool:
    """Every part is still its row block of `fused`, in order, covering it."""
    if fused is None:
        return False
    row = 0
    for part in parts:
        if row >= fused.shape[0] or part.data_ptr() != fused[row].data_ptr():
            return False
        row += part.shape[0]
    return row == fused.shape[0]


def is_fused(owner: nn.Module, linears: list[nn.Module]) -> bool:
    """Every linear's weight is still its block of the owner's fused matrix (a weight whose
    storage was replaced, e.g. by `module.to(dtype)`, is not: its updates would miss the matrix)."""
    plain, packed = _split(linears)
    if plain and not _stacked(getattr(owner, "fused_weight", None), [lin.weight for lin in plain]):
        return False
    return not packed or (_stacked(getattr(owner, "fused_fp8_weight", None), [lin.weight for lin in packed])
                          and _stacked(getattr(owner, "fused_fp8_scale", None), [lin.weight_scale for lin in packed]))


def fuse_linears(owner: nn.Module, linears: list[nn.Module]) -> None:
    """(Re)build the owner's fused matrix from the linears' current weights; nothing to do when
    they are still its views."""
    if not linears or is_fused(owner, linears):
        return
    if any(getattr(lin, "bias", None) is not None for lin in linears):
        raise ValueError(f"{type(owner).__name__}: fused projections take bias-free linears")
    plain, packed = _split(linears)
    if plain:
        fused = torch.cat([lin.weight.detach() for lin in plain])
        owner.register_buffer("fused_weight", fused, persistent=False)
        row = 0
        for lin in plain:
            rows = lin.weight.shape[0]
            lin.weight.data = fused[row:row + rows]
            row += rows
    if packed:
        _fuse_packed(owner, packed)


def _fuse_packed(owner: nn.Module, linears: list[Fp8Linear]) -> None:
    """Stack the packed weights' bytes and scale tables; each linear's weight and weight_scale become
    views of its blocks (its own scale_row still indexes its own table)."""
    q = torch.cat([lin.weight for lin in linears])
    scale = torch.cat([lin.weight_scale for lin in linears])
    first = [0]
    for lin in linears:
        first.append(first[-1] + lin.weight_scale.shape[0])
    scale_row = torch.cat([lin.scale_row + f for lin, f in zip(linears, first)])
    owner.register_buffer("fused_fp8_weight", q, persistent=False)
    owner.register_buffer("fused_fp8_scale", scale, persistent=False)
    owner.register_buffer("fused_fp8_scale_row", scale_row, persistent=False)
    row = 0
    for lin, f, f_next in zip(linears, first, first[1:]):
        rows = lin.weight.shape[0]
        lin.weight = q[row:row + rows]
        lin.weight_scale = scale[f:f_next]
        row += rows


def project(owner: nn.Module, linears: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    plain, packed = _split(linears)
    if not packed:
        return _project_plain(owner, linears, x)
    outs = iter(_project_plain(owner, plain, x) if plain else [])
    q = getattr(owner, "fused_fp8_weight", None)
    if q is None:
        packed_outs = iter([lin(x) for lin in packed])
    else:
        y = fp8_linear(x, q, owner.fused_fp8_scale, owner.fused_fp8_scale_row)
        packed_outs = iter(y.split([lin.weight.shape[0] for lin in packed], dim=-1))
    return [next(packed_outs) if isinstance(lin, Fp8Linear) else next(outs) for lin in linears]


def _project_plain(owner: nn.Module, linears: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    fused = getattr(owner, "fused_weight", None)
    if fused is None:  # whole rows (whole_rows.py): the fixed-order GEMM
        return [linear(x, lin.weight) for lin in linears]
    return list(F.linear(x, fused).split([lin.weight.shape[0] for lin in linears], dim=-1))
