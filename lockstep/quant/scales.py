"""Power-of-two block scales (UE8M0) shared by the fp8 and fp4 formats.

A UE8M0 scale is 2**e with e an integer in [-127, 127]: 8 exponent bits, no sign, no
mantissa. DeepSeek's checkpoints store it as `torch.float8_e8m0fnu` (one byte, bias 127,
0xFF is NaN); in memory we also carry it as float32, where every such value is exact.

Choosing the scale for a block with absolute maximum `amax` and format maximum `fmt_max`:

    scale = 2 ** ceil(log2(amax / fmt_max))       (rounded UP, so amax / scale <= fmt_max)

`round_up_pow2` does the ceil with `torch.frexp`, which is exact, instead of `log2`, which is
rounded and can put a value just above 2**k onto 2**k (and a quantised value above fmt_max).
"""

from __future__ import annotations

import torch

from lockstep.quant.errors import QuantFormatError, where

E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
E8M0 = torch.float8_e8m0fnu


def div_by_const(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c correctly rounded on every device.

    On CUDA, PyTorch divides a tensor by a Python scalar as a multiplication by the scalar's
    rounded reciprocal, which is not IEEE division: fp32 block scales (amax / 448) then differed
    from the CPU's (on an H200, 1,016 of the 1,792 scales of a random 4096x7168 bf16 weight), and
    a ue8m0 scale can double where amax / 448 sits at a power of two. Dividing by a tensor is IEEE
    division on CPU and CUDA alike, and matches Triton's div_rn: with it the pure-PyTorch functions
    give the same bytes on CPU and CUDA, and the Triton kernel the same as both (checked on an H200).
    """
    return torch.div(x, torch.full_like(x, c))


def round_up_pow2(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0, float32), exponent clamped to e8m0's [-127, 127]."""
    x = x.float()
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    exp = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exp = exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    return torch.ldexp(torch.ones_like(x), exp)


def is_pow2(x: torch.Tensor) -> torch.Tensor:
    """Elementwise: x is a positive power of two (float32 view)."""
    mantissa, _ = torch.frexp(x.float())
    return mantissa == 0.5


def scale_to_e8m0(scale: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """float32 power-of-two scales -> `torch.float8_e8m0fnu`, exactly; raises if any is not 2**e."""
    if scale.dtype == E8M0:
        return scale
    s = scale.float()
    exp = torch.frexp(s)[1] - 1
    ok = is_pow2(s) & (exp >= E8M0_MIN_EXP) & (exp <= E8M0_MAX_EXP)
    # Inside a compiled graph (the trainer's quantisation-aware forward in a compiled whole-rows step)
    # a host read of `ok` cannot be traced; there the scales come from round_up_pow2, powers of two by
    # construction. Scales read from files are converted eagerly and checked here.
    if not torch.compiler.is_compiling() and not bool(ok.all()):
        bad = s[~ok].flatten()[:3].tolist()
        raise QuantFormatError(
            where(name, f"scale values {bad} are not powers of two in [2**-127, 2**127]; cannot store as e8m0")
        )
    # Build the byte directly (biased exponent) rather than trust a float cast's rounding.
    return (exp + 127).to(torch.uint8).view(E8M0)


def scale_from_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """`torch.float8_e8m0fnu` (or any float) scales -> float32. e8m0 NaN (0xFF) stays NaN."""
    return scale.float()
