"""Triton kernels for the weight push's re-quantisation on the GPU: fp8 e4m3 with one scale per
128x128 block (custom op `lockstep::quantize_fp8_block_`) and, in fp4_triton.py, fp4 e2m1 with
e8m0 scales per 1x32 (`lockstep::quantize_fp4_block_`). Both write into preallocated storage.

Caller: `fp8.quantize_fp8_block` / `fp4.quantize_fp4_block` take the kernel for CUDA tensors in
eager mode (`eligible`); CPU tensors, and everything under torch.compile, keep the PyTorch rule,
which is the definition and the tests' oracle. So the packed push (Fp8Linear.load_,
PackedExperts.load_) and the emulated served values (serving_format.served_value) on a GPU get
the kernel without a switch of their own.

Bit-for-bit the reference (tests/quant/test_fp8_triton.py, under TRITON_INTERPRET=1), by:
  - IEEE-rounded division (`div_rn`) for amax / fmt_max and w / scale (scales.div_by_const);
  - the power-of-two round-up done on the float's bits, following scales.round_up_pow2 (frexp)
    case by case: a power of two stays, anything else goes up one exponent; fp32-subnormal
    amax / fmt_max goes to 2**-127 (<= 2**-127) or 2**-126; amax / fmt_max == 0 (an all-zero
    block, or an fp32 amax so small the division underflows) gives 1, as frexp(0)'s exponent 0
    does; a block holding NaN or inf gives 1 (frexp's exponent of NaN / inf on CPU is 0);
  - e4m3 rounding (nearest even, e4m3 subnormals below 2**-6 in steps of 2**-9) done in fp32
    arithmetic with exact power-of-two steps, then the code built from the bits: no fp32 -> fp8
    cast (the interpreter's does not round to nearest even). Saturation at 448 (the clamp).
    The code's sign is the input's sign bit, so -0.0 and values rounding to zero keep it; NaN
    gives 0x7F | sign (torch's CPU cast of a NaN keeps its sign; a CUDA division would not).
    Non-finite weights never reach a push (weight_update rejects them): this only pins NaN down.
  - fp32-format scales (scale_fmt="fp32"): bitwise for finite blocks; non-finite ones get NaN
    codes whose sign bit is the platform's (not pinned down).

Launch: one program per 128x128 block (8 warps). Owed, GPU: this kernel's bitwise check against
the reference on CUDA (LOCKSTEP_TEST_DEVICE=cuda runs the same tests compiled) and its bandwidth
(benchmarks/weight_push.py prints the push's ratio to the copy bound); neither has been run.
"""

from __future__ import annotations

import torch

from lockstep.quant.blocks import n_blocks
from lockstep.triton_support import load_triton

triton = load_triton()  # None: fp8.py's PyTorch path is always there
if triton is not None:
    import triton.language as tl

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BYTE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)  # e8m0 scale storage


def eligible(w: torch.Tensor) -> bool:
    """The kernels are taken for this tensor: Triton present, a CUDA float tensor, eager mode."""
    return (triton is not None and w.device.type == "cuda" and w.dtype in FLOAT_DTYPES
            and not torch.compiler.is_compiling())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


if triton is not None:

    @triton.jit
    def _pow2_scale(amax, special, FMT_MAX: tl.constexpr, UE8M0: tl.constexpr):
        """scales.py's scale for a block with absolute maximum amax (fp32); `special`: the block
        holds a NaN (which tl.max may skip). Returns (scale fp32, its e8m0 byte as int32)."""
        s = tl.math.div_rn(amax, FMT_MAX)
        bits = s.to(tl.int32, bitcast=True)
        exp_field = (bits >> 23) & 0xFF
        if UE8M0:
            mant = bits & 0x7FFFFF
            up = tl.where(mant != 0, (exp_field + 1) << 23, exp_field << 23)
            sub = tl.where(mant <= 0x400000, 0x00400000, 0x00800000)  # 2**-127 or 2**-126
            bits = tl.where(exp_field == 0, sub, up)
            one = special | (s == 0.0) | (exp_field == 0xFF)  # NaN / inf block, or amax / max == 0
            bits = tl.where(one, 0x3F800000, bits)
        else:
            bits = tl.where(amax == 0.0, 0x3F800000, tl.maximum(bits, 0x00800000))
        scale = bits.to(tl.float32, bitcast=True)
        return scale, (bits >> 23) & 0xFF

    @triton.jit
    def _e4m3_code(x, scale):
        """The e4m3 byte of clamp(x / scale, -448, 448), rounded to nearest even (int32 0..255)."""
        v = tl.math.div_rn(x, scale)
        a = tl.minimum(tl.abs(v), 448.0)
        exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(exp, -6) - 3  # the grid step at a is 2**e
        step = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)
        magic = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds to an integer, ties to even
        r = ((a * inv_step + magic) - magic) * step  # on the e4m3 grid, <= 448
        rb = r.to(tl.int32, bitcast=True)
        er = (rb >> 23) & 0xFF
        normal = ((er - 120) << 3) | ((rb >> 20) & 7)  # r >= 2**-6: biased exponent 7
        code = tl.where(er >= 121, normal, (r * 512.0).to(tl.int32))  # else a multiple of 2**-9
        code = tl.where(x != x, 0x7F, code)
        sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
        return code | sign

    @triton.jit
    def _fp8_block_kernel(w_ptr, q_ptr, s_ptr, rows, cols, stride_wm, stride_wr, nbr, nbc,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, UE8M0: tl.constexpr,
                          SCALE_BYTES: tl.constexpr):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        mat = tl.program_id(2).to(tl.int64)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (offs_r[:, None] < rows) & (offs_c[None, :] < cols)
        w_offs = mat * stride_wm + offs_r[:, None].to(tl.int64) * stride_wr + offs_c[None, :]
        x = tl.load(w_ptr + w_offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        has_nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0) > 0
        scale, byte = _pow2_scale(amax, has_nan, 448.0, UE8M0)
        code = _e4m3_code(x, scale)
        q_offs = mat * rows * cols + offs_r[:, None].to(tl.int64) * cols + offs_c[None, :]
        tl.store(q_ptr + q_offs, code.to(tl.uint8), mask=mask)
        s_off = (mat * nbr + pid_r) * nbc + pid_c
        if SCALE_BYTES:
            tl.store(s_ptr + s_off, byte.to(tl.uint8))
        else:
            tl.store(s_ptr + s_off, scale)

    @torch.library.triton_op("lockstep::quantize_fp8_block_", mutates_args={"q", "scale"})
    def quantize_fp8_block_(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_r: int, block_c: int,
                            ue8m0: bool) -> None:
        """w [M, R, C] (C contiguous) -> q [M, R, C] contiguous (float8_e4m3fn or uint8 bytes) and
        scale [M, ceil(R/block_r), ceil(C/block_c)] contiguous (float32, or e8m0 bytes: uint8 /
        float8_e8m0fnu, ue8m0 only), written in place."""
        mats, rows, cols = w.shape
        nbr, nbc = n_blocks(rows, block_r), n_blocks(cols, block_c)
        if w.numel() == 0:
            return
        torch.library.wrap_triton(_fp8_block_kernel)[(nbr, nbc, mats)](
            w, _bytes(q), _bytes(scale) if scale.dtype in BYTE_DTYPES else scale, rows, cols,
            w.stride(0), w.stride(1), nbr, nbc, BLOCK_R=block_r, BLOCK_C=block_c, UE8M0=ue8m0,
            SCALE_BYTES=scale.dtype in BYTE_DTYPES, num_warps=8)


def quantize_fp8_into(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      scale_fmt: str) -> None:
    """fp8.quantize_fp8_block's rule, by the kernel, into q [..., R, C] and scale [..., nbr, nbc]
    (both contiguous; float32 scales, or e8m0 bytes when scale_fmt is "ue8m0")."""
    br, bc = int(block[0]), int(block[1])
    if br & (br - 1) or bc & (bc - 1) or br < 1 or bc < 1:
        raise ValueError(f"the Triton fp8 kernel needs power-of-two blocks, got {br}x{bc}")
    if scale.dtype in BYTE_DTYPES and scale_fmt != "ue8m0":
        raise ValueError("e8m0 scale storage needs scale_fmt='ue8m0'")
    if not (q.is_contiguous() and scale.is_contiguous()):
        raise ValueError("the Triton fp8 kernel writes contiguous q and scale")
    *lead, rows, cols = w.shape
    w3 = w.reshape(-1, rows, cols)
    if w3.stride(-1) != 1:
        w3 = w3.contiguous()
    torch.ops.lockstep.quantize_fp8_block_(w3, q, scale, br, bc, scale_fmt == "ue8m0")
