"""FP8 e4m3 weights with one scale per 128x128 block (DeepSeek-V3/V4's "fine-grained fp8").

Layout: weight q [..., out, in] `torch.float8_e4m3fn`; scale [..., ceil(out/128), ceil(in/128)].
Dequantisation: w = q * scale, the scale broadcast over its block. Quantisation of a block
with absolute maximum amax (computed in float32):

    scale = amax / 448                      scale_fmt="fp32"  (V3 style, any float32)
    scale = 2 ** ceil(log2(amax / 448))     scale_fmt="ue8m0" (V4 style, a power of two,
                                             rounded UP so no |w / scale| exceeds 448)
    q = clamp(w / scale, -448, 448).to(float8_e4m3fn)   (round to nearest even)

An all-zero block gets scale 1. UE8M0 scales may be carried as float32 or stored as
`torch.float8_e8m0fnu` (the official checkpoints' dtype); `scale_to_e8m0` / `scale_from_e8m0`
convert exactly.

Round trips. With ue8m0 scales every dequantised value q * 2**k is exactly representable, so
dequant(quant(x)) == x for any such x, and quant(dequant(q, s)) == (q, s) for every block whose
max |q| exceeds 224 (= 448 / 2; that is the case for blocks quant produced unless the block's
largest value rounded down to exactly 224, where quant returns (2q, s/2): the same values).
With fp32 scales a quantised block's max |q| is 448 and fl(fl(448 * s) / 448) == s for
s = fl(amax / 448), so quant(dequant(q, s)) == (q, s) holds as well when dequantising to
float32 (not to bf16: q * s is generally not a bf16 value).
"""

from __future__ import annotations

import torch

from lockstep.quant.blocks import from_blocks, scale_shape, to_blocks
from lockstep.quant import fp8_triton
from lockstep.quant.errors import QuantFormatError, where
from lockstep.quant.scales import E8M0, div_by_const, round_up_pow2, scale_from_e8m0, scale_to_e8m0

FP8_E4M3_MAX = 448.0
FP8_BLOCK = (128, 128)
SCALE_FMTS = ("ue8m0", "fp32")
SCALE_DTYPES = (torch.float32, E8M0, torch.bfloat16, torch.float16, torch.float64)

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_BLOCK",
    "quantize_fp8_block",
    "quantize_fp8_blocks_into",
    "dequantize_fp8_block",
    "fp8_scale_shape",
    "check_fp8_scale",
    "scale_to_e8m0",
    "scale_from_e8m0",
]


def fp8_scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, ...]:
    """[..., out, in] -> [..., ceil(out/block0), ceil(in/block1)]."""
    return scale_shape(tuple(weight_shape), tuple(block))


def _names(name: str | None) -> tuple[str | None, str | None]:
    """(weight name, scale name) for messages: `x.weight` pairs with `x.scale`."""
    if not name:
        return None, None
    for w_suffix, s_suffix in ((".weight", ".scale"), (".weight", ".weight_scale_inv")):
        if name.endswith(s_suffix):
            return name[: -len(s_suffix)] + w_suffix, name
    if name.endswith(".weight"):
        return name, name[: -len(".weight")] + ".scale"
    return name, f"{name} (scale)"


def check_fp8_scale(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, name: str | None = None
) -> None:
    """Raise QuantFormatError unless q is e4m3 and scale is a float tensor of the block-scale shape."""
    w_name, s_name = _names(name)
    if q.dtype != torch.float8_e4m3fn:
        raise QuantFormatError(where(w_name, f"dtype {q.dtype} is not an fp8 e4m3 weight (torch.float8_e4m3fn)"))
    if q.dim() < 2:
        raise QuantFormatError(where(w_name, f"fp8 block weight must be at least 2-D, got shape {tuple(q.shape)}"))
    if scale.dtype not in SCALE_DTYPES:
        raise QuantFormatError(
            where(s_name, f"dtype {scale.dtype} is not a block-scale dtype (float32 or float8_e8m0fnu)")
        )
    expected = fp8_scale_shape(tuple(q.shape), block)
    if tuple(scale.shape) != expected:
        raise QuantFormatError(
            where(
                s_name,
                f"shape {tuple(scale.shape)} does not fit weight {tuple(q.shape)} with "
                f"{block[0]}x{block[1]} blocks; expected {expected}",
            )
        )


def quantize_fp8_block(
    w: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    scale_fmt: str = "ue8m0",
    *,
    scale_dtype: torch.dtype = torch.float32,
    name: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] (any float dtype) -> (q float8_e4m3fn [..., out, in], scale [..., ceil(out/b0), ceil(in/b1)]).

    `scale_dtype` is float32 (default) or torch.float8_e8m0fnu (ue8m0 only). `out` = (q, scale):
    preallocated storage written in place and returned (q float8_e4m3fn or uint8 bytes; scale
    float32, or e8m0 bytes as float8_e8m0fnu / uint8, which then decides the scale storage).
    CUDA tensors in eager mode are quantised by the Triton kernel (fp8_triton.py, bitwise this
    rule); everything else by the PyTorch code below, which defines the rule.
    """
    if scale_fmt == "float":  # transformers' spelling of fp32 scales
        scale_fmt = "fp32"
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    if scale_dtype not in (torch.float32, E8M0):
        raise ValueError(f"scale_dtype must be torch.float32 or torch.float8_e8m0fnu, got {scale_dtype}")
    if scale_dtype == E8M0 and scale_fmt != "ue8m0":
        raise ValueError("e8m0 scale storage needs scale_fmt='ue8m0' (power-of-two scales)")
    if w.dim() < 2 or not w.is_floating_point():
        raise QuantFormatError(where(name, f"cannot fp8-quantise a {w.dtype} tensor of shape {tuple(w.shape)}"))
    block = (int(block[0]), int(block[1]))
    if out is not None:
        _check_out(w, out, block)
        scale_dtype = E8M0 if out[1].dtype in fp8_triton.BYTE_DTYPES else torch.float32
        if scale_dtype == E8M0 and scale_fmt != "ue8m0":
            raise ValueError("e8m0 scale storage needs scale_fmt='ue8m0' (power-of-two scales)")
    if _kernel_takes(w, block):
        q, scale = out if out is not None else (
            torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
            torch.empty(fp8_scale_shape(tuple(w.shape), block), dtype=scale_dtype, device=w.device))
        fp8_triton.quantize_fp8_into(w.detach(), q, scale, block, scale_fmt)
        return q, scale
    rows, cols = w.shape[-2:]
    wb = to_blocks(w.float(), block)  # [..., nbr, br, nbc, bc]
    amax = wb.abs().amax(dim=(-3, -1))  # [..., nbr, nbc]
    scale = div_by_const(amax, FP8_E4M3_MAX)
    if scale_fmt == "ue8m0":
        scale = round_up_pow2(scale)
    else:
        # A float32 scale that is subnormal would make w / scale overflow or lose bits.
        scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    qb = (wb / scale[..., :, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = from_blocks(qb, rows, cols).to(torch.float8_e4m3fn)
    if scale_dtype == E8M0:
        scale = scale_to_e8m0(scale, name)
    if out is not None:
        _copy_bytes(out[0], q)
        if scale.dtype == E8M0:
            _copy_bytes(out[1], scale)
        else:
            out[1].copy_(scale)
        return out
    return q, scale


def quantize_fp8_blocks_into(ws: list[torch.Tensor], outs: list[tuple[torch.Tensor, torch.Tensor]],
                             block: tuple[int, int] = FP8_BLOCK, scale_fmt: str = "ue8m0", layout=None,
                             gate: torch.Tensor | None = None) -> None:
    """quantize_fp8_block(w, block, scale_fmt, out=out) for every pair, those the kernel takes
    (`fp8_triton.eligible`) in one launch per group (fp8_triton.quantize_fp8_many_into): a weight
    push writes all of an engine's packed fp8 weights at once. `layout`: a key the caller vouches
    fixes every w's dtype and shape and every out (a weight update's WritePlan): where its launch is
    kept for these addresses, the per-weight checks, which passed then, are skipped. `gate`: the
    kernel's (fp8_triton.quantize_fp8_many_into), where it takes every w (`kernel_takes_all`)."""
    if gate is not None and not kernel_takes_all(ws, block):
        raise ValueError("a gated quantisation needs the kernel to take every weight (kernel_takes_all)")
    if layout is not None and fp8_triton.launch_kept(ws, outs, block, scale_fmt, layout, gate):
        return  # this layout's checks passed before (the weight update's kept WritePlan)
    batch = []
    for w, out in zip(ws, outs):
        if _kernel_takes(w, block):
            _check_out(w, out, block)
            batch.append((w.detach(), out))
        else:
            quantize_fp8_block(w, block, scale_fmt, out=out)
    if batch:
        fp8_triton.quantize_fp8_many_into([w for w, _ in batch], [out for _, out in batch], block, scale_fmt,
                                          layout if len(batch) == len(ws) else None, gate)


def kernel_takes_all(ws: list[torch.Tensor], block: tuple[int, int] = FP8_BLOCK) -> bool:
    """quantize_fp8_blocks_into quantises every w by the kernel (so it may be gated)."""
    return all(_kernel_takes(w, block) for w in ws)


def _kernel_takes(w: torch.Tensor, block: tuple[int, int]) -> bool:
    """The Triton kernel quantises w (fp8_triton.eligible: CUDA, eager) in power-of-two blocks."""
    return fp8_triton.eligible(w) and all(b > 0 and b & (b - 1) == 0 for b in block)


def _check_out(w: torch.Tensor, out, block: tuple[int, int]) -> None:
    q, scale = out
    if tuple(q.shape) != tuple(w.shape) or q.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"out q must be float8_e4m3fn or uint8 of shape {tuple(w.shape)}, got {q.dtype} "
                         f"{tuple(q.shape)}")
    expected = fp8_scale_shape(tuple(w.shape), block)
    if tuple(scale.shape) != expected or scale.dtype not in (torch.float32, *fp8_triton.BYTE_DTYPES):
        raise ValueError(f"out scale must be float32 or e8m0 bytes of shape {expected}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")


def _copy_bytes(dest: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one-byte values as bytes (a float8 -> uint8 copy_ would convert the values)."""
    dest.view(torch.uint8).copy_(src.view(torch.uint8))


def dequantize_fp8_block(
    q: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
    block: tuple[int, int] = FP8_BLOCK,
) -> torch.Tensor:
    """q float8_e4m3fn [..., out, in] * per-block scale -> out_dtype [..., out, in] (product in float32)."""
    block = (int(block[0]), int(block[1]))
    check_fp8_scale(q, scale, block, name)
    rows, cols = q.shape[-2:]
    s = scale_from_e8m0(scale) if scale.dtype == E8M0 else scale.float()
    xb = to_blocks(q.float(), block) * s[..., :, None, :, None]
    return from_blocks(xb, rows, cols).to(out_dtype)
