"""FP4 e2m1 weights with a power-of-two scale per 1x32 block (MXFP4 style; DeepSeek-V4's routed experts).

E2M1 is 1 sign, 2 exponent and 1 mantissa bit. The 3 magnitude bits (code & 7) index

    code   0    1    2    3    4    5    6    7
    value  0    0.5  1    1.5  2    3    4    6        and bit 3 (0x8) is the sign.

Layout: two codes per byte along the last (K = in) dim, the FIRST element in the LOW nibble:
packed [..., out, in/2] uint8 (int8 storage, as the official checkpoints use, and
torch.float4_e2m1fn_x2 are accepted on input); scale [..., out, ceil(in/32)] e8m0
(`torch.float8_e8m0fnu`, or float32 powers of two).

Quantisation of a 1x32 block with absolute maximum amax:

    scale = 2 ** ceil(log2(amax / 6))   (round up, so |w / scale| <= 6; all-zero block: 1)
    code  = round-to-nearest-even of w / scale onto the grid (ties go to the even code:
            0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)

Round trips: every value v * 2**k is representable, so dequant(quant(x)) == x exactly for such x;
quant(dequant(p, s)) == (p, s) for blocks whose max |v| is 4 or 6 (a block whose largest value
is 3 or less comes back as (2v or 4v..., s/2 or s/4...): the same values).
"""

from __future__ import annotations

import torch

from lockstep.quant import fp4_triton, fp8_triton
from lockstep.quant.errors import QuantFormatError, where
from lockstep.quant.scales import E8M0, div_by_const, round_up_pow2, scale_from_e8m0, scale_to_e8m0

FP4_E2M1_MAX = 6.0
FP4_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
PACKED_DTYPES = (torch.uint8, torch.int8, torch.float4_e2m1fn_x2)
SCALE_DTYPES = (E8M0, torch.float32)

# Rounding boundaries between consecutive magnitudes, and whether a tie goes up (to an even code).
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)

__all__ = [
    "FP4_E2M1_MAX",
    "FP4_BLOCK",
    "E2M1_VALUES",
    "float_to_e2m1",
    "e2m1_to_float",
    "pack_e2m1",
    "unpack_e2m1",
    "quantize_fp4_block",
    "quantize_fp4_blocks_into",
    "dequantize_fp4_block",
    "fp4_scale_shape",
    "check_fp4_scale",
]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round x (already divided by its scale) to the nearest e2m1 code, ties to even, saturating at 6.

    Returns uint8 codes 0..15; the sign bit follows x's sign bit (so -0.0 -> 0x8)."""
    a = x.float().abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in zip(_BOUNDS, _TIE_UP):
        code += (a >= bound if tie_up else a > bound).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 codes 0..15 -> their values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=codes.device)
    return table[codes.long()]


def _as_uint8(packed: torch.Tensor, name: str | None = None) -> torch.Tensor:
    if packed.dtype not in PACKED_DTYPES:
        raise QuantFormatError(
            where(name, f"dtype {packed.dtype} is not packed e2m1 storage (uint8, int8 or float4_e2m1fn_x2)")
        )
    return packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> bytes [..., K/2]: element 2j in the low nibble, 2j+1 in the high."""
    if codes.shape[-1] % 2:
        raise QuantFormatError(f"cannot pack an odd number ({codes.shape[-1]}) of e2m1 values per row")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] (uint8, int8 or float4_e2m1fn_x2) -> uint8 codes [..., K]."""
    p = _as_uint8(packed)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def fp4_scale_shape(weight_shape: tuple[int, ...], block: int = FP4_BLOCK) -> tuple[int, ...]:
    """Unpacked [..., out, in] -> [..., out, ceil(in/block)]."""
    *lead, cols = weight_shape
    return (*lead, -(-cols // block))


def _scale_name(name: str | None) -> str | None:
    if name and name.endswith(".weight"):
        return name[: -len(".weight")] + ".scale"
    return f"{name} (scale)" if name else None


def check_fp4_scale(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK, name: str | None = None) -> None:
    """Raise QuantFormatError unless packed is e2m1 bytes and scale fits it ([..., out, ceil(2*in_packed/block)])."""
    _as_uint8(packed, name)
    if packed.dim() < 1:
        raise QuantFormatError(where(name, "packed e2m1 weight must have at least one dim"))
    if scale.dtype not in SCALE_DTYPES:
        raise QuantFormatError(
            where(_scale_name(name), f"dtype {scale.dtype} is not an e8m0 scale (float8_e8m0fnu or float32)")
        )
    unpacked = (*packed.shape[:-1], 2 * packed.shape[-1])
    expected = fp4_scale_shape(unpacked, block)
    if tuple(scale.shape) != expected:
        raise QuantFormatError(
            where(
                _scale_name(name),
                f"shape {tuple(scale.shape)} does not fit packed fp4 weight {tuple(packed.shape)} "
                f"(unpacked {unpacked}) with 1x{block} blocks; expected {expected}",
            )
        )


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> [..., ceil(K/block), block], zero-padded."""
    k = x.shape[-1]
    pad = -k % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], (k + pad) // block, block)


def quantize_fp4_block(
    w: torch.Tensor,
    block: int = FP4_BLOCK,
    *,
    scale_dtype: torch.dtype = E8M0,
    name: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] (in even) -> (packed uint8 [..., out, in/2], scale [..., out, ceil(in/block)]).

    `scale_dtype` is torch.float8_e8m0fnu (default) or torch.float32 (the same powers of two).
    `out` = (packed, scale): preallocated storage written in place and returned (packed: uint8 /
    int8 / float4_e2m1fn_x2 bytes; scale: e8m0 bytes as float8_e8m0fnu / uint8, or float32, which
    then decides the scale storage). CUDA tensors in eager mode are quantised by the Triton kernel
    (fp4_triton.py, bitwise this rule); everything else by the PyTorch code below, the rule."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be torch.float8_e8m0fnu or torch.float32, got {scale_dtype}")
    if w.dim() < 1 or not w.is_floating_point():
        raise QuantFormatError(where(name, f"cannot fp4-quantise a {w.dtype} tensor of shape {tuple(w.shape)}"))
    if w.shape[-1] % 2:
        raise QuantFormatError(where(name, f"last dim {w.shape[-1]} is odd; e2m1 packs two values per byte"))
    k = w.shape[-1]
    if out is not None:
        _check_out(w, out, block)
        scale_dtype = E8M0 if out[1].dtype in fp8_triton.BYTE_DTYPES else torch.float32
    if _kernel_takes(w, block):
        packed, scale = out if out is not None else (
            torch.empty(*w.shape[:-1], k // 2, dtype=torch.uint8, device=w.device),
            torch.empty(fp4_scale_shape(tuple(w.shape), block), dtype=scale_dtype, device=w.device))
        fp4_triton.quantize_fp4_into(w.detach(), packed, scale, block)
        return packed, scale
    xb = _blocked(w.float(), block)  # [..., nb, block]
    amax = xb.abs().amax(dim=-1)  # [..., nb]
    scale = round_up_pow2(div_by_const(amax, FP4_E2M1_MAX))
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    codes = float_to_e2m1(xb / scale[..., None]).flatten(-2)[..., :k]  # flatten: a reshape to -1 fails on 0 rows
    packed = pack_e2m1(codes)
    if scale_dtype == E8M0:
        scale = scale_to_e8m0(scale, _scale_name(name))
    if out is not None:
        out[0].view(torch.uint8).copy_(packed)
        if scale.dtype == E8M0:
            out[1].view(torch.uint8).copy_(scale.view(torch.uint8))
        else:
            out[1].copy_(scale)
        return out
    return packed, scale


def quantize_fp4_blocks_into(ws: list[torch.Tensor], outs: list[tuple[torch.Tensor, torch.Tensor]],
                             block: int = FP4_BLOCK, layout=None, gate: torch.Tensor | None = None) -> None:
    """quantize_fp4_block(w, block, out=out) for every pair, those the kernel takes
    (`fp8_triton.eligible`) in one launch per group (fp4_triton.quantize_fp4_many_into): a weight
    push writes all of an engine's fp4 experts at once. `layout`, `gate`: as quantize_fp8_blocks_into's."""
    if gate is not None and not kernel_takes_all(ws, block):
        raise ValueError("a gated quantisation needs the kernel to take every weight (kernel_takes_all)")
    if layout is not None and fp4_triton.launch_kept(ws, outs, block, layout, gate):
        return  # this layout's checks passed before (the weight update's kept WritePlan)
    batch = []
    for w, out in zip(ws, outs):
        if _kernel_takes(w, block):
            _check_out(w, out, block)
            batch.append((w.detach(), out))
        else:
            quantize_fp4_block(w, block, out=out)
    if batch:
        fp4_triton.quantize_fp4_many_into([w for w, _ in batch], [out for _, out in batch], block,
                                          layout if len(batch) == len(ws) else None, gate)


def kernel_takes_all(ws: list[torch.Tensor], block: int = FP4_BLOCK) -> bool:
    """quantize_fp4_blocks_into quantises every w by the kernel (so it may be gated)."""
    return all(_kernel_takes(w, block) for w in ws)


def _kernel_takes(w: torch.Tensor, block: int) -> bool:
    """The Triton kernel quantises w (fp8_triton.eligible: CUDA, eager; an even last dim, two codes a
    byte; an odd one is refused by quantize_fp4_block) in power-of-two blocks."""
    return fp8_triton.eligible(w) and block >= 2 and block & (block - 1) == 0 and w.shape[-1] % 2 == 0


def _check_out(w: torch.Tensor, out, block: int) -> None:
    packed, scale = out
    expected = (*w.shape[:-1], w.shape[-1] // 2)
    if tuple(packed.shape) != expected or packed.dtype not in PACKED_DTYPES:
        raise ValueError(f"out packed must be e2m1 bytes of shape {expected}, got {packed.dtype} {tuple(packed.shape)}")
    expected = fp4_scale_shape(tuple(w.shape), block)
    if tuple(scale.shape) != expected or scale.dtype not in (torch.float32, *fp8_triton.BYTE_DTYPES):
        raise ValueError(f"out scale must be e8m0 bytes or float32 of shape {expected}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")


def dequantize_fp4_block(
    packed: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
    block: int = FP4_BLOCK,
) -> torch.Tensor:
    """packed e2m1 [..., out, in/2] with scale [..., out, ceil(in/block)] -> out_dtype [..., out, in]."""
    check_fp4_scale(packed, scale, block, name)
    values = e2m1_to_float(unpack_e2m1(packed))  # [..., K] float32
    k = values.shape[-1]
    s = scale_from_e8m0(scale) if scale.dtype == E8M0 else scale.float()
    xb = _blocked(values, block) * s[..., None]
    return xb.flatten(-2)[..., :k].to(out_dtype)
