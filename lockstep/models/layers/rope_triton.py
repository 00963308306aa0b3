"""rope.apply_rope with gradients as one Triton kernel each way (the trainer's rotary embeddings:
the attention's q, kv and output, the compressors' entries, the indexer's queries).

apply_rope rotates the trailing R = 2 * cos.shape[-1] channels of each row in adjacent pairs, in
fp32, and rounds once to x's dtype; the leading channels pass through. Eager, that is ~10 kernels
forward (the slice, the cast, the four products, the two sums, the stack, the cast back, the
concatenation) and ~15 backward, five times in a compressed layer; here one:
    out[2i]   = x[2i] cos_i - x[2i+1] sin_i,    out[2i+1] = x[2i+1] cos_i + x[2i] sin_i
The backward is the inverse rotation, the same kernel with -sin (the pass-through channels pass
the gradient through), so nothing but cos and sin is kept for it.

Rows: x viewed as [T, G, D] where cos / sin are [T, R / 2] broadcast over G (the heads: a caller's
cos.unsqueeze(-2)); shapes that broadcast otherwise take the eager ops (`applies`).

Numerics: the same fp32 products and sums and one rounding, up to the GPU compiler's choice of
fusing a product into the sum (an FMA: the last fp32 bit, rarely the rounded one). Where it runs
(`applies`): CUDA bf16 (or the interpreter with the switch set to True: the CPU tests, bf16 or
fp32), a gradient wanted, eager, and the `triton_rope` switch (kernel_switch.py;
TrainConfig.triton_rope), on by default on CUDA (an H200, 1b config: 1.05x the train step alone).
"""

from __future__ import annotations

import math

import torch

from lockstep.triton_support import interpreted, trainer_kernel_takes

from . import grouped_gemm_triton as _gt
from .kernel_switch import grad_wanted

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_R = 16  # rows per program


def _row_groups(x: torch.Tensor, cos: torch.Tensor) -> tuple[int, int] | None:
    """(T, G): x's rows as T groups of G sharing one cos row; None if cos broadcasts otherwise."""
    lead, cos_lead = x.shape[:-1], cos.shape[:-1]
    if len(cos_lead) != len(lead):
        return None
    k = len(lead)
    while k > 0 and cos_lead[k - 1] == 1 and lead[k - 1] != 1:  # the broadcast (head) axes: trailing
        k -= 1
    if tuple(cos_lead[:k]) != tuple(lead[:k]) or any(c != 1 for c in cos_lead[k:]):
        return None
    return math.prod(lead[:k]), math.prod(lead[k:])


def applies(x: torch.Tensor, cos: torch.Tensor, enabled: bool | None) -> bool:
    """Whether apply_rope takes the kernel (module docstring)."""
    if triton is None or torch.compiler.is_compiling() or not grad_wanted(x):
        return False
    return trainer_kernel_takes(x, enabled) and 2 * cos.shape[-1] <= x.shape[-1] and _row_groups(x, cos) is not None


def rope_with_grad(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(x, cos, sin) as the kernel, with its backward (cos, sin: no gradient)."""
    return RotaryEmbedding.apply(x, cos, sin)


class RotaryEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T, G = _row_groups(x, cos)
        cos, sin = (t.detach().float().reshape(T, -1).contiguous() for t in (cos, sin))
        ctx.save_for_backward(cos, sin)
        ctx.groups = T, G
        return _rotate(x, cos, sin, T, G)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, -sin, *ctx.groups), None, None  # the inverse rotation


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, T: int, G: int) -> torch.Tensor:
    D = x.shape[-1]
    x2 = x.contiguous()
    out = torch.empty_like(x2)
    rows = T * G
    if rows:
        _rope_kernel[(triton.cdiv(rows, BLOCK_R),)](x2, cos, sin, out, rows, G, D=D, HALF=cos.shape[-1],
                                                    BLOCK_D=triton.next_power_of_2(D), BLOCK_R=BLOCK_R,
                                                    BF16=x.dtype == torch.bfloat16, INTERPRETED=interpreted())
    return out.view(x.shape)


if triton is not None:
    _bf16 = _gt._bf16  # by name: torch.compile's compile worker cannot resolve a module alias

    @triton.jit
    def _cos_sin(positions, inv_freq_ptr, j, rotated):
        """rope_cos_sin inside a kernel: positions [R] (integers) times inv_freq[j] (fp32, j [C]) where
        `rotated` [C] -> cos, sin [R, C], 1 and 0 elsewhere. The same fp32 product, and on a GPU the
        same cos / sin (libdevice's: what inductor's kernels and torch's call) as the torch form."""
        angle = positions.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + j, mask=rotated, other=0.0)[None, :]
        return tl.where(rotated[None, :], tl.cos(angle), 1.0), tl.where(rotated[None, :], tl.sin(angle), 0.0)

    @triton.jit
    def _rotate_pairs(x, cos, sin, rotated, R: tl.constexpr, C: tl.constexpr):
        """apply_rope's products on a tile x [R, C] (fp32) held whole in registers: channel pairs
        (2i, 2i + 1) where rotated [C / 2] turned by cos / sin [R or 1, C / 2] (fp32), the others as
        they are. For kernels that load whole rows (the decode step's); this trainer kernel loads
        each channel's partner instead."""
        even, odd = tl.split(tl.reshape(x, (R, C // 2, 2)))
        y_even = tl.where(rotated[None, :], even * cos - odd * sin, even)
        y_odd = tl.where(rotated[None, :], odd * cos + even * sin, odd)
        return tl.reshape(tl.join(y_even, y_odd), (R, C))

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, rows, G, D: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """BLOCK_R rows: the last 2 HALF channels rotated in pairs by their row group's angle."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_D)
        in_row = (r[:, None] < rows) & (c[None, :] < D)
        base = r[:, None].to(tl.int64) * D
        x = tl.load(x_ptr + base + c[None, :], mask=in_row, other=0.0)
        j = c - (D - 2 * HALF)  # the channel's place among the rotated ones (< 0: passes through)
        rotated = (j >= 0)[None, :] & in_row
        odd = (j % 2 == 1)[None, :]
        partner = tl.where(odd, c[None, :] - 1, c[None, :] + 1)  # the other channel of the pair
        xp = tl.load(x_ptr + base + partner, mask=rotated, other=0.0).to(tl.float32)
        angle = (r // G)[:, None].to(tl.int64) * HALF + (j // 2)[None, :]
        cs = tl.load(cos_ptr + angle, mask=rotated, other=0.0)
        sn = tl.load(sin_ptr + angle, mask=rotated, other=0.0)
        y = x.to(tl.float32) * cs + tl.where(odd, xp * sn, -(xp * sn))
        if BF16:
            y = _bf16(y, INTERPRETED)
        tl.store(out_ptr + base + c[None, :], tl.where(rotated, y, x), mask=in_row)
