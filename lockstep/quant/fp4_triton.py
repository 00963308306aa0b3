"""Triton kernel for fp4 e2m1 quantisation with one e8m0 scale per 1x32 block, two codes per byte
(custom op `lockstep::quantize_fp4_block_`); `fp4.quantize_fp4_block` is its reference and its
caller for CUDA tensors (fp8_triton.eligible; fp8_triton.py's docstring has the why and the rules).

Bit-for-bit the reference: the scale by fp8_triton._pow2_scale with fmt_max 6 (NaN / inf blocks and
amax / 6 == 0 get 1); x / scale with div_rn; the code by fp4.float_to_e2m1's boundaries (ties to
the even code, saturating at 6, a NaN gives magnitude 0) and the input's sign bit; element 2j in
the low nibble. A program owns BLOCK_R rows x BLOCK_K columns (BLOCK_K a multiple of 32).
Owed, GPU: the bitwise check on CUDA and the bandwidth, as for the fp8 kernel.
"""

from __future__ import annotations

import torch

from lockstep.quant.fp8_triton import BYTE_DTYPES, _bytes, triton

if triton is not None:
    import triton.language as tl

    from lockstep.quant.fp8_triton import _pow2_scale

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
    def _fp4_block_kernel(w_ptr, p_ptr, s_ptr, rows, cols, stride_wr, nb,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                          SCALE_BYTES: tl.constexpr):
        NB: tl.constexpr = BLOCK_K // BLOCK
        offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        r_ok = offs_r[:, None] < rows
        x = tl.load(w_ptr + offs_r[:, None].to(tl.int64) * stride_wr + offs_c[None, :],
                    mask=r_ok & (offs_c[None, :] < cols), other=0.0).to(tl.float32)
        x3 = tl.reshape(x, (BLOCK_R, NB, BLOCK))
        amax = tl.max(tl.abs(x3), axis=2)
        has_nan = tl.max((x3 != x3).to(tl.int32), axis=2) > 0
        scale, byte = _pow2_scale(amax, has_nan, 6.0, True)
        v = tl.reshape(tl.math.div_rn(x3, scale[:, :, None]), (BLOCK_R, BLOCK_K))
        code = _e2m1_code(v, x)
        lo, hi = tl.split(tl.reshape(code, (BLOCK_R, BLOCK_K // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        offs_p = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        half = cols // 2
        tl.store(p_ptr + offs_r[:, None].to(tl.int64) * half + offs_p[None, :], packed,
                 mask=r_ok & (offs_p[None, :] < half))
        offs_b = tl.program_id(1) * NB + tl.arange(0, NB)
        s_ptrs = s_ptr + offs_r[:, None].to(tl.int64) * nb + offs_b[None, :]
        s_ok = r_ok & (offs_b[None, :] < nb)
        if SCALE_BYTES:
            tl.store(s_ptrs, byte.to(tl.uint8), mask=s_ok)
        else:
            tl.store(s_ptrs, scale, mask=s_ok)

    @torch.library.triton_op("lockstep::quantize_fp4_block_", mutates_args={"packed", "scale"})
    def quantize_fp4_block_(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, block: int) -> None:
        """w [R, K] (K even, last dim contiguous) -> packed [R, K/2] bytes (uint8 / int8 /
        float4_e2m1fn_x2) and scale [R, ceil(K/block)] (e8m0 bytes, or float32), both contiguous,
        written in place."""
        rows, cols = w.shape
        if w.numel() == 0:
            return
        block_k = max(block, min(256, triton.next_power_of_2(cols)))
        block_r = max(1, 4096 // block_k)
        grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_k))
        scale_bytes = scale.dtype in BYTE_DTYPES
        torch.library.wrap_triton(_fp4_block_kernel)[grid](
            w, _bytes(packed), _bytes(scale) if scale_bytes else scale, rows, cols, w.stride(0),
            scale.shape[-1], BLOCK_R=block_r, BLOCK_K=block_k, BLOCK=block, SCALE_BYTES=scale_bytes,
            num_warps=4)


def quantize_fp4_into(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """fp4.quantize_fp4_block's rule, by the kernel, into packed [..., K/2] and scale [..., nb]."""
    if block < 2 or block & (block - 1):
        raise ValueError(f"the Triton fp4 kernel needs a power-of-two block, got {block}")
    if not (packed.is_contiguous() and scale.is_contiguous()):
        raise ValueError("the Triton fp4 kernel writes contiguous packed bytes and scales")
    w2 = w.reshape(-1, w.shape[-1])
    if w2.stride(-1) != 1:
        w2 = w2.contiguous()
    torch.ops.lockstep.quantize_fp4_block_(w2, packed.view(-1, packed.shape[-1]), scale.view(-1, scale.shape[-1]),
                                           block)
