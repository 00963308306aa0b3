"""Tiling a [..., rows, cols] tensor into [..., n_row_blocks, rows_per_block, n_col_blocks, cols_per_block].

Edge blocks of shapes that are not multiples of the block are zero-padded for the reduction
(zeros never raise a block's amax) and the padding is cut off again afterwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def n_blocks(size: int, block: int) -> int:
    return -(-size // block)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the per-block scale of a [..., rows, cols] tensor."""
    *lead, rows, cols = shape
    return (*lead, n_blocks(rows, block[0]), n_blocks(cols, block[1]))


def to_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[..., R, C] -> [..., R/br, br, C/bc, bc] (zero-padded up to whole blocks)."""
    *lead, rows, cols = x.shape
    br, bc = block
    pad_r, pad_c = n_blocks(rows, br) * br - rows, n_blocks(cols, bc) * bc - cols
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(*lead, (rows + pad_r) // br, br, (cols + pad_c) // bc, bc)


def from_blocks(xb: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `to_blocks`: [..., R/br, br, C/bc, bc] -> [..., R, C], padding removed."""
    *lead, nbr, br, nbc, bc = xb.shape
    x = xb.reshape(*lead, nbr * br, nbc * bc)
    if x.shape[-2] != rows or x.shape[-1] != cols:
        x = x[..., :rows, :cols].contiguous()
    return x
