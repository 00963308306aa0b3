"""Triton kernel for fp8 e4m3 block quantisation; `fp8.quantize_fp8_block` is its reference.

One program per (matrix, row block, column block): load the block (masked at the edges), take
amax in float32, derive the scale exactly as the reference does, and store q and the scale.
Bit-for-bit agreement with the reference needs:
  - IEEE-rounded division (`div_rn`) for amax / 448 and w / scale, not the approximate `/`;
  - the ue8m0 round-up done on the float's bits (exponent + 1 when any mantissa bit is set;
    e8m0's smallest value 2**-127 is an fp32 subnormal, handled explicitly);
  - round-to-nearest-even onto the e4m3 grid done in float32 arithmetic (`_round_to_e4m3`), so
    the final cast only meets representable values: Triton's interpreter does not round the
    fp32 -> fp8 cast to nearest even (0.90625 became 0.9375), and we want one code path.
Testable on CPU with TRITON_INTERPRET=1 (tests/quant/test_fp8_triton.py).
"""

from __future__ import annotations

import torch

from lockstep.quant.blocks import n_blocks
from lockstep.quant.fp8 import FP8_BLOCK, FP8_E4M3_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # the pure-PyTorch path in fp8.py is always there
    triton = None

_FP32_TINY_BITS = 0x00800000  # 2**-126, smallest normal float32
_E8M0_MIN_BITS = 0x00400000  # 2**-127 as a float32 subnormal


if triton is not None:

    @triton.jit
    def _round_to_e4m3(v):
        """v (float32, |v| <= 448) rounded to nearest even on the e4m3 grid, still float32."""
        # e4m3 has 3 mantissa bits and a smallest normal exponent of -6 (below it: steps of 2**-9),
        # so the grid step at v is 2**(max(floor(log2|v|), -6) - 3), a power of two.
        bits = v.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127
        step = ((tl.maximum(exp, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        # Adding and subtracting 1.5 * 2**23 rounds |v| / step <= 16 to an integer, ties to even.
        magic = 12582912.0
        r = ((tl.abs(v) / step + magic) - magic) * step
        # Put v's sign bit back, so values that round to zero keep it (-0.0) as torch's cast does.
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_block_quant_kernel(
        w_ptr,
        q_ptr,
        s_ptr,
        rows,
        cols,
        stride_w_mat,
        stride_w_row,
        stride_q_mat,
        stride_q_row,
        n_row_blocks,
        n_col_blocks,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        UE8M0: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        mat = tl.program_id(2)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (offs_r[:, None] < rows) & (offs_c[None, :] < cols)
        w_offs = mat * stride_w_mat + offs_r[:, None] * stride_w_row + offs_c[None, :]
        x = tl.load(w_ptr + w_offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.math.div_rn(amax, 448.0)
        bits = scale.to(tl.int32, bitcast=True)
        if UE8M0:
            exp_field = (bits >> 23) & 0xFF
            mant = bits & 0x7FFFFF
            up = tl.where(mant != 0, (exp_field + 1) << 23, exp_field << 23)
            # fp32 subnormal amax / 448: e8m0 bottoms out at 2**-127 (a subnormal), else 2**-126
            sub = tl.where(mant <= 0x400000, 0x00400000, 0x00800000)
            bits = tl.where(exp_field == 0, sub, up)
        else:
            bits = tl.maximum(bits, 0x00800000)
        scale = bits.to(tl.float32, bitcast=True)
        scale = tl.where(amax == 0.0, 1.0, scale)
        q = tl.math.div_rn(x, scale)
        q = _round_to_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
        q_offs = mat * stride_q_mat + offs_r[:, None] * stride_q_row + offs_c[None, :]
        tl.store(q_ptr + q_offs, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(s_ptr + (mat * n_row_blocks + pid_r) * n_col_blocks + pid_c, scale)


def triton_available() -> bool:
    return triton is not None


def quantize_fp8_block_triton(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, scale_fmt: str = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `fp8.quantize_fp8_block` (float32 scales); block dims must be powers of two."""
    if triton is None:
        raise RuntimeError("triton is not installed; use lockstep.quant.fp8.quantize_fp8_block")
    if scale_fmt == "float":
        scale_fmt = "fp32"
    if scale_fmt not in ("ue8m0", "fp32"):
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'fp32', got {scale_fmt!r}")
    br, bc = int(block[0]), int(block[1])
    if br & (br - 1) or bc & (bc - 1):
        raise ValueError(f"triton block quantisation needs power-of-two blocks, got {br}x{bc}")
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"cannot fp8-quantise a {w.dtype} tensor of shape {tuple(w.shape)}")
    *lead, rows, cols = w.shape
    w3 = w.reshape(-1, rows, cols).contiguous()
    mats = w3.shape[0]
    nbr, nbc = n_blocks(rows, br), n_blocks(cols, bc)
    q = torch.empty(w3.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty((mats, nbr, nbc), dtype=torch.float32, device=w.device)
    if q.numel():
        _fp8_block_quant_kernel[(nbr, nbc, mats)](
            w3, q, s, rows, cols, w3.stride(0), w3.stride(1), q.stride(0), q.stride(1), nbr, nbc,
            BLOCK_R=br, BLOCK_C=bc, UE8M0=scale_fmt == "ue8m0",
        )  # fmt: skip
    return q.reshape(*lead, rows, cols), s.reshape(*lead, nbr, nbc)


assert FP8_E4M3_MAX == 448.0  # the kernel hard-codes it
