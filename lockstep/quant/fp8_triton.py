"""Triton kernels for the weight push's re-quantisation on the GPU: fp8 e4m3 with one scale per
128x128 block (`quantize_fp8_many_into`) and, in fp4_triton.py, fp4 e2m1 with e8m0 scales per
1x32 (`quantize_fp4_many_into`): many tensors in one launch each, written into preallocated storage.

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
  - e4m3 rounding (nearest even, e4m3 subnormals below 2**-6 in steps of 2**-9): on a GPU by its
    conversion instruction (`cvt.rn.satfinite.e4m3x2.f32`, sm_89+; tests/gpu_compile.py checks the
    PTX holds it, and the tests compiled on a GPU compare with the CPU reference); under the
    interpreter, whose fp32 -> fp8 cast does not round to nearest even, in fp32 arithmetic with
    exact power-of-two steps, the code built from the bits. Saturation at 448 (the clamp).
    The code's sign is the input's sign bit, so -0.0 and values rounding to zero keep it; NaN
    gives 0x7F | sign (torch's CPU cast of a NaN keeps its sign; a CUDA division would not).
    Non-finite weights never reach a push (weight_update rejects them): this only pins NaN down.
  - fp32-format scales (scale_fmt="fp32"): bitwise for finite blocks; non-finite ones get NaN
    codes whose sign bit is the platform's (not pinned down).

Launch: one program per 128x128 block (4 warps, 32 rows at a time) of any of the tensors of one
launch, which reads its tensor's addresses and strides from a table (lockstep/tensor_tables.py: int64 addresses cast to
typed pointers, 16-byte aligned where the host found them so; the block table, by the shapes only,
is made once per set of shapes and kept on the device). Launched directly, not as a custom op: eager
only (`eligible`), and a custom op's call cost ~66 us of host time where a direct launch costs ~20.
An fp8 engine's push quantises all of its fp8 weights in one or two launches
(engine/weight_update.write_served), where a launch per tensor was ~80 launches on gpu-848m.
gpu-848m's 1.7 GB of bf16 weights (docs/speed.md, 2026-12-05): 6.33 ms on an
H200 before the alignment hint, then 2.26 ms; 32-row passes 1.34x faster (H200), the GPU's
conversion 1.33x more (H100: 1.72 -> 1.29 ms, where a copy of the same bytes took 1.15 ms).
"""

from __future__ import annotations

import torch

from lockstep.quant.blocks import n_blocks
from lockstep.tensor_tables import (W_DTYPES, PreparedLaunches, address_table, alignment, call_key,
                                    launch_table, open_gate, unit_stride)
from lockstep.triton_support import interpreted, load_triton

triton = load_triton()  # None: fp8.py's PyTorch path is always there
if triton is not None:
    import triton.language as tl

    from lockstep.tensor_tables import table_int, table_pointer

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BYTE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)  # e8m0 scale storage
CHUNK_ROWS = 32  # rows of a block a program converts at a time (_quantize_block says why)


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
    def _divided(x, scale, POW2: tl.constexpr):
        """x / scale, IEEE-rounded. POW2 (a power-of-two scale): x times 1 / scale, the same value (both
        round the one real number x 2^-e; 1 / scale is exact) at a multiply per value, where a
        division is a dozen instructions."""
        if POW2:
            return x * tl.math.div_rn(1.0, scale)
        return tl.math.div_rn(x, scale)

    @triton.jit
    def _e4m3_code(x, scale, POW2: tl.constexpr, HW: tl.constexpr):
        """The e4m3 byte of clamp(x / scale, -448, 448), rounded to nearest even (int32 0..255). HW: by
        the GPU's conversion (sm_89+ `cvt.rn.satfinite.e4m3x2.f32`, two values an instruction), else
        by fp32 arithmetic (the interpreter's cast does not round to nearest even); the same bytes."""
        v = _divided(x, scale, POW2)
        sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
        if HW:
            c = tl.minimum(tl.maximum(v, -448.0), 448.0)
            code = c.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
            return tl.where(x != x, 0x7F | sign, code)
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
        return code | sign

    @triton.jit
    def _block_rows(w_ptr, mat, row0, offs_c, rows, cols, stride_wm, stride_wr, CHUNK_R: tl.constexpr):
        """Rows row0 .. row0 + CHUNK_R of matrix `mat`, columns offs_c, as fp32 (0 outside w), and
        their mask and row offsets."""
        offs_r = row0 + tl.arange(0, CHUNK_R)
        mask = (offs_r[:, None] < rows) & (offs_c[None, :] < cols)
        x = tl.load(w_ptr + mat * stride_wm + offs_r[:, None].to(tl.int64) * stride_wr + offs_c[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        return x, mask, offs_r

    @triton.jit
    def _quantize_block(w_ptr, q_ptr, s_ptr, mat, pid_r, pid_c, rows, cols, stride_wm, stride_wr, nbr, nbc,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK_R: tl.constexpr, UE8M0: tl.constexpr,
                        SCALE_BYTES: tl.constexpr, HW: tl.constexpr):
        """Block (pid_r, pid_c) of matrix `mat` of w [M, rows, cols] into q [M, rows, cols] and its
        scale into s [M, nbr, nbc] (both contiguous), CHUNK_R rows at a time: a pass for the block's
        absolute maximum, a second (its reads from L2) for the codes. Why not the block at once: 64
        values a thread held registers the conversion needed (one H200: gpu-848m's 1.7 GB 2.26 ms
        at once, 1.68 ms by 32 rows and 4 warps, arithmetic conversion both; 0.63 ms moving the
        bytes alone)."""
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        amax = tl.zeros((), tl.float32)
        nan = tl.zeros((), tl.int32)
        for r0 in tl.static_range(0, BLOCK_R, CHUNK_R):
            x, _, _ = _block_rows(w_ptr, mat, pid_r * BLOCK_R + r0, offs_c, rows, cols, stride_wm, stride_wr,
                                  CHUNK_R)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
            nan = tl.maximum(nan, tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0))
        scale, byte = _pow2_scale(amax, nan > 0, 448.0, UE8M0)
        for r0 in tl.static_range(0, BLOCK_R, CHUNK_R):
            x, mask, offs_r = _block_rows(w_ptr, mat, pid_r * BLOCK_R + r0, offs_c, rows, cols, stride_wm,
                                          stride_wr, CHUNK_R)
            code = _e4m3_code(x, scale, UE8M0, HW)
            tl.store(q_ptr + mat * rows * cols + offs_r[:, None].to(tl.int64) * cols + offs_c[None, :],
                     code.to(tl.uint8), mask=mask)
        s_off = (mat * nbr + pid_r) * nbc + pid_c
        s_ok = pid_r * BLOCK_R < rows  # always, but where a closed gate took the rows (_many_tensor_program)
        if SCALE_BYTES:
            tl.store(s_ptr + s_off, byte.to(tl.uint8), mask=s_ok)
        else:
            tl.store(s_ptr + s_off, scale, mask=s_ok)

    @triton.jit
    def _many_tensor_program(addr_ptr, meta_ptr, tensor_ptr, local_ptr, T, gate_ptr, W_DTYPE: tl.constexpr,
                             SCALE_BYTES: tl.constexpr, ALIGN: tl.constexpr):
        """A many-tensor quantisation program's tensor t = tensor[program] (launch_table,
        address_table): (t, its index within t, meta [t, 0..3], w's typed pointer (bf16 / fp16 / fp32),
        the output bytes' pointer, the scales' pointer (e8m0 bytes or fp32)); addr_ptr holds rows w,
        out, s addresses of T tensors, then their strides. ALIGN: the w and out addresses (bytes) and
        meta's columns are multiples of it (`alignment`). A closed gate (not 0) reads as a tensor of
        no rows: every load and store is masked (a gated write, engine/value_checks.DeviceChecks)."""
        t = tl.load(tensor_ptr + tl.program_id(0))
        local = tl.load(local_ptr + tl.program_id(0)).to(tl.int64)
        m0, m1 = tl.load(meta_ptr + 4 * t), table_int(meta_ptr + 4 * t + 1, ALIGN)
        m0 = tl.where(tl.load(gate_ptr) == 0, m0, 0)
        m2, m3 = tl.load(meta_ptr + 4 * t + 2), tl.load(meta_ptr + 4 * t + 3)
        w_ptr = table_pointer(addr_ptr + t, W_DTYPE, ALIGN)
        out_ptr = table_pointer(addr_ptr + T + t, 3, ALIGN)
        s_ptr = table_pointer(addr_ptr + 2 * T + t, 3 if SCALE_BYTES else 2, 1)
        return t, local, m0, m1, m2, m3, w_ptr, out_ptr, s_ptr

    @triton.jit
    def _fp8_many_kernel(addr_ptr, meta_ptr, tensor_ptr, local_ptr, T, gate_ptr, W_DTYPE: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK_R: tl.constexpr, UE8M0: tl.constexpr,
                         SCALE_BYTES: tl.constexpr, ALIGN: tl.constexpr, HW: tl.constexpr):
        """One block of a tensor: addresses w, q, s and w's two strides; meta rows, cols, nbr, nbc."""
        t, local, rows, cols, nbr, nbc, w_ptr, q_ptr, s_ptr = _many_tensor_program(
            addr_ptr, meta_ptr, tensor_ptr, local_ptr, T, gate_ptr, W_DTYPE, SCALE_BYTES, ALIGN)
        per_mat = nbr * nbc
        rem = local % per_mat
        _quantize_block(w_ptr, q_ptr, s_ptr, local // per_mat, rem // nbc, rem % nbc, rows, cols,
                        table_int(addr_ptr + 3 * T + t, ALIGN), table_int(addr_ptr + 4 * T + t, ALIGN), nbr, nbc,
                        BLOCK_R, BLOCK_C, CHUNK_R, UE8M0, SCALE_BYTES, HW)


def quantize_fp8_into(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      scale_fmt: str) -> None:
    """fp8.quantize_fp8_block's rule, by the kernel, into q [..., R, C] and scale [..., nbr, nbc]
    (both contiguous; float32 scales, or e8m0 bytes when scale_fmt is "ue8m0")."""
    quantize_fp8_many_into([w], [(q, scale)], block, scale_fmt)


def _block_table(shapes: tuple[tuple[int, int, int], ...], block: tuple[int, int], device: torch.device):
    """launch_table for every 128x128 (`block`) block of tensors [M, rows, cols]; meta rows, cols, nbr, nbc."""
    meta = tuple((r, c, n_blocks(r, block[0]), n_blocks(c, block[1])) for _, r, c in shapes)
    return launch_table(tuple(m * nbr * nbc for (m, _, _), (_, _, nbr, nbc) in zip(shapes, meta)), meta, device)


def quantize_fp8_many_into(ws: list[torch.Tensor], outs: list[tuple[torch.Tensor, torch.Tensor]],
                           block: tuple[int, int], scale_fmt: str, layout=None,
                           gate: torch.Tensor | None = None) -> None:
    """quantize_fp8_into for many tensors: one launch per group of one w dtype, one scale storage and
    one alignment (`alignment`) (an fp8 engine's push: one or two launches where a launch per tensor
    cost ~60 us of host time each, ~80 tensors on gpu-848m), prepared once per set of tensors
    (`PreparedLaunches`; by `layout` and addresses where given, `_many_key`). Block and scale rules as
    quantize_fp8_into. `gate`: as tensor_copy_triton.copy_many's (nothing written where it is closed)."""
    _PREPARED.launch(_fp8_many_kernel, _many_key(ws, outs, (tuple(block), scale_fmt, interpreted()), layout),
                     lambda: _fp8_launches(ws, outs, block, scale_fmt), gate_argument(outs, gate))


def launch_kept(ws: list[torch.Tensor], outs: list[tuple[torch.Tensor, torch.Tensor]], block: tuple[int, int],
                scale_fmt: str, layout, gate: torch.Tensor | None = None) -> bool:
    """quantize_fp8_many_into's launch where one is kept for this `layout` and these addresses (the
    caller's checks passed on them before): whether it was launched (never without Triton: no kernel
    to keep)."""
    if triton is None:
        return False
    settings = (tuple(block), scale_fmt, interpreted())
    return _PREPARED.launch_kept(_fp8_many_kernel, _many_key(ws, outs, settings, layout), gate_argument(outs, gate))


def gate_argument(outs: list[tuple[torch.Tensor, ...]], gate: torch.Tensor | None) -> tuple:
    """The many-tensor kernels' last argument: the caller's gate, else one always open (fp4_triton's too)."""
    return (gate if gate is not None else open_gate(outs[0][0].device),) if outs else ()


def _many_key(ws, outs, settings: tuple, layout) -> tuple:
    """A many-tensor quantisation's PreparedLaunches key (`call_key`): by the layout and the addresses
    where the caller gives a layout (it fixes every dtype and shape) and every w is contiguous (the
    layout fixes no strides). fp4_triton's too."""
    return call_key(settings, ws, outs, layout if layout is not None and all(w.is_contiguous() for w in ws) else None)


_PREPARED = PreparedLaunches()


def _fp8_launches(ws, outs, block, scale_fmt) -> tuple[list, list[torch.Tensor]]:
    """(the launches of quantize_fp8_many_into, the contiguous copies of w they read)."""
    br, bc = int(block[0]), int(block[1])
    if br & (br - 1) or bc & (bc - 1) or br < 1 or bc < 1:
        raise ValueError(f"the Triton fp8 kernel needs power-of-two blocks, got {br}x{bc}")
    groups: dict[tuple, list] = {}  # (w dtype, e8m0 bytes, alignment) -> [(w [M, R, C], q, scale)]
    copies = []
    for w, (q, scale) in zip(ws, outs):
        if scale.dtype in BYTE_DTYPES and scale_fmt != "ue8m0":
            raise ValueError("e8m0 scale storage needs scale_fmt='ue8m0'")
        if not (q.is_contiguous() and scale.is_contiguous()):
            raise ValueError("the Triton fp8 kernel writes contiguous q and scale")
        if w.numel():
            *_, rows, cols = w.shape
            w3 = unit_stride(w, (-1, rows, cols), copies)
            groups.setdefault((w.dtype, scale.dtype in BYTE_DTYPES,
                               alignment([w3.data_ptr(), q.data_ptr()], [*w3.stride()[:2], cols])), []).append(
                (w3, _bytes(q), _bytes(scale) if scale.dtype in BYTE_DTYPES else scale))
    launches = []
    for (w_dtype, scale_bytes, align), items in groups.items():
        device = items[0][0].device
        tensor, local, meta = _block_table(tuple(tuple(w3.shape) for w3, _, _ in items), (br, bc), device)
        addresses = address_table([[w3.data_ptr() for w3, _, _ in items], [q.data_ptr() for _, q, _ in items],
                                   [s.data_ptr() for _, _, s in items], [w3.stride(0) for w3, _, _ in items],
                                   [w3.stride(1) for w3, _, _ in items]], device)
        launches.append(((tensor.numel(),), (addresses, meta, tensor, local, len(items)), dict(
            W_DTYPE=W_DTYPES[w_dtype], BLOCK_R=br, BLOCK_C=bc, CHUNK_R=min(br, CHUNK_ROWS), UE8M0=scale_fmt == "ue8m0",
            SCALE_BYTES=scale_bytes, ALIGN=align, HW=not interpreted(), num_warps=4)))
    return launches, copies
