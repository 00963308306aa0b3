"""Triton kernel for fp4 e2m1 quantisation with one e8m0 scale per 1x32 block, two codes per byte,
many tensors in one launch (`quantize_fp4_many_into`, as fp8_triton.py's: addresses from a table,
launched directly); `fp4.quantize_fp4_block` is its reference and its caller for CUDA tensors
(fp8_triton.eligible; fp8_triton.py's docstring has the why and the rules).

Bit-for-bit the reference: the scale by fp8_triton._pow2_scale with fmt_max 6 (NaN / inf blocks and
amax / 6 == 0 get 1); x / scale IEEE-rounded (fp8_triton._divided); the code by fp4.float_to_e2m1's
boundaries (ties to the even code, saturating at 6, a NaN gives magnitude 0) and the input's sign
bit; element 2j in the low nibble. A program owns BLOCK_R rows x BLOCK_K columns (BLOCK_K a
multiple of 32).
Owed, GPU: the bitwise check on CUDA and the bandwidth, as for the fp8 kernel.
"""

from __future__ import annotations

import torch

from lockstep.quant.blocks import n_blocks
from lockstep.quant.fp8_triton import BYTE_DTYPES, _bytes, _many_key, gate_argument, triton
from lockstep.tensor_tables import (W_DTYPES, PreparedLaunches, address_table, alignment, launch_table,
                                    unit_stride)

if triton is not None:
    import triton.language as tl

    from lockstep.quant.fp8_triton import _divided, _many_tensor_program, _pow2_scale
    from lockstep.tensor_tables import table_int

    @triton.jit
    def _e2m1_code(v, x):
        """e2m1 code (int32 0..15) of v = x / scale: fp4._BOUNDS, ties up at 0.75, 1.75, 3.5."""
        a = tl.abs(v)
        code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32))
        code = tl.where(x != x, 0, code)
        return code | ((x.to(tl.int32, bitcast=True) >> 28) & 0x8)

    @triton.jit
    def _quantize_tile(w_ptr, p_ptr, s_ptr, pid_r, pid_c, rows, cols, stride_wr, nb,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                       SCALE_BYTES: tl.constexpr):
        """Rows pid_r x columns pid_c (BLOCK_R x BLOCK_K) of w [rows, cols] into packed [rows, cols / 2]
        and their scales into s [rows, nb] (both contiguous)."""
        NB: tl.constexpr = BLOCK_K // BLOCK
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = pid_c * BLOCK_K + tl.arange(0, BLOCK_K)
        r_ok = offs_r[:, None] < rows
        x = tl.load(w_ptr + offs_r[:, None].to(tl.int64) * stride_wr + offs_c[None, :],
                    mask=r_ok & (offs_c[None, :] < cols), other=0.0).to(tl.float32)
        x3 = tl.reshape(x, (BLOCK_R, NB, BLOCK))
        amax = tl.max(tl.abs(x3), axis=2)
        has_nan = tl.max((x3 != x3).to(tl.int32), axis=2) > 0
        scale, byte = _pow2_scale(amax, has_nan, 6.0, True)
        v = tl.reshape(_divided(x3, scale[:, :, None], True), (BLOCK_R, BLOCK_K))
        code = _e2m1_code(v, x)
        lo, hi = tl.split(tl.reshape(code, (BLOCK_R, BLOCK_K // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        offs_p = pid_c * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        half = cols // 2
        tl.store(p_ptr + offs_r[:, None].to(tl.int64) * half + offs_p[None, :], packed,
                 mask=r_ok & (offs_p[None, :] < half))
        offs_b = pid_c * NB + tl.arange(0, NB)
        s_ptrs = s_ptr + offs_r[:, None].to(tl.int64) * nb + offs_b[None, :]
        s_ok = r_ok & (offs_b[None, :] < nb)
        if SCALE_BYTES:
            tl.store(s_ptrs, byte.to(tl.uint8), mask=s_ok)
        else:
            tl.store(s_ptrs, scale, mask=s_ok)

    @triton.jit
    def _fp4_many_kernel(addr_ptr, meta_ptr, tensor_ptr, local_ptr, T, gate_ptr, W_DTYPE: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                         SCALE_BYTES: tl.constexpr, ALIGN: tl.constexpr):
        """One BLOCK_R x BLOCK_K tile of a tensor: addresses w, packed, s and w's row stride; meta
        rows, cols, nb, column tiles."""
        t, local, rows, cols, nb, col_tiles, w_ptr, p_ptr, s_ptr = _many_tensor_program(
            addr_ptr, meta_ptr, tensor_ptr, local_ptr, T, gate_ptr, W_DTYPE, SCALE_BYTES, ALIGN)
        _quantize_tile(w_ptr, p_ptr, s_ptr, local // col_tiles, local % col_tiles, rows, cols,
                       table_int(addr_ptr + 3 * T + t, ALIGN), nb, BLOCK_R, BLOCK_K, BLOCK, SCALE_BYTES)


def quantize_fp4_into(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """fp4.quantize_fp4_block's rule, by the kernel, into packed [..., K/2] and scale [..., nb]."""
    quantize_fp4_many_into([w], [(packed, scale)], block)


def _tiles(cols: int, block: int) -> tuple[int, int]:
    """(rows, columns) of a program's tile: up to 256 columns (a multiple of the block), ~4096 values."""
    block_k = max(block, min(256, 1 << (cols - 1).bit_length()))  # Python's: triton's is a JIT function (~4 us)
    return max(1, 4096 // block_k), block_k


def quantize_fp4_many_into(ws: list[torch.Tensor], outs: list[tuple[torch.Tensor, torch.Tensor]], block: int,
                           layout=None, gate: torch.Tensor | None = None) -> None:
    """quantize_fp4_into for many tensors: one launch per group of one w dtype, one scale storage, one
    tile shape and one alignment (an fp8-fp4 engine's push: its routed experts in one launch, where a
    launch per tensor cost ~60 us of host time each), prepared once per set of tensors
    (tensor_tables.PreparedLaunches). w [..., K] (K even), packed [..., K/2] bytes (uint8 / int8 /
    float4_e2m1fn_x2) and scale [..., ceil(K/block)] (e8m0 bytes, or float32). `layout`, `gate`: as
    fp8_triton.quantize_fp8_many_into's."""
    _PREPARED.launch(_fp4_many_kernel, _many_key(ws, outs, (block,), layout), lambda: _fp4_launches(ws, outs, block),
                     gate_argument(outs, gate))


def launch_kept(ws: list[torch.Tensor], outs: list[tuple[torch.Tensor, torch.Tensor]], block: int, layout,
                gate: torch.Tensor | None = None) -> bool:
    """quantize_fp4_many_into's launch where one is kept for this `layout` and these addresses (the
    caller's checks passed on them before): whether it was launched (never without Triton: no kernel
    to keep)."""
    if triton is None:
        return False
    return _PREPARED.launch_kept(_fp4_many_kernel, _many_key(ws, outs, (block,), layout), gate_argument(outs, gate))


_PREPARED = PreparedLaunches()


def _fp4_launches(ws, outs, block: int) -> tuple[list, list[torch.Tensor]]:
    """(the launches of quantize_fp4_many_into, the contiguous copies of w they read)."""
    if block < 2 or block & (block - 1):
        raise ValueError(f"the Triton fp4 kernel needs a power-of-two block, got {block}")
    groups: dict[tuple, list] = {}  # (w dtype, e8m0 bytes, tile) -> [(w [R, K], packed [R, K/2], scale [R, nb])]
    copies = []
    for w, (packed, scale) in zip(ws, outs):
        if not (packed.is_contiguous() and scale.is_contiguous()):
            raise ValueError("the Triton fp4 kernel writes contiguous packed bytes and scales")
        if w.numel():
            w2 = unit_stride(w, (-1, w.shape[-1]), copies)
            scale_bytes = scale.dtype in BYTE_DTYPES
            p2 = _bytes(packed).view(-1, packed.shape[-1])
            align = alignment([w2.data_ptr(), p2.data_ptr()], [w2.stride(0), w2.shape[1]])
            groups.setdefault((w.dtype, scale_bytes, _tiles(w.shape[-1], block), align), []).append(
                (w2, p2, (_bytes(scale) if scale_bytes else scale).view(-1, scale.shape[-1])))
    launches = []
    for (w_dtype, scale_bytes, (block_r, block_k), align), items in groups.items():
        device = items[0][0].device
        meta = tuple((w2.shape[0], w2.shape[1], s2.shape[1], n_blocks(w2.shape[1], block_k)) for w2, _, s2 in items)
        tensor, local, meta_t = launch_table(tuple(n_blocks(r, block_r) * tiles for r, _, _, tiles in meta), meta,
                                             device)
        addresses = address_table([[w2.data_ptr() for w2, _, _ in items], [p2.data_ptr() for _, p2, _ in items],
                                   [s2.data_ptr() for _, _, s2 in items], [w2.stride(0) for w2, _, _ in items]],
                                  device)
        launches.append(((tensor.numel(),), (addresses, meta_t, tensor, local, len(items)), dict(
            W_DTYPE=W_DTYPES[w_dtype], BLOCK_R=block_r, BLOCK_K=block_k, BLOCK=block, SCALE_BYTES=scale_bytes,
            ALIGN=align, num_warps=4)))
    return launches, copies
