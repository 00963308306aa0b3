"""Partial, interleaved rotary embeddings (DeepSeek-V4 style) with plain and YaRN frequencies.

Only the trailing `rope_dim` channels of a head rotate; channel pairs are adjacent
(x[2i], x[2i+1]) rather than split into halves. Window-only layers use plain RoPE with
`rope_theta`; compressed layers (and their compressors and indexer) use `compress_rope_theta`
with optional YaRN scaling whose attention factor is forced to 1 (the reference does not
rescale cos/sin).

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): frequencies whose
wavelength fits many times in the original context keep their value (extrapolation), those
that rotate less than `beta_slow` times are divided by `factor` (interpolation), and a linear
ramp blends the two between the correction dims of `beta_fast` and `beta_slow` rotations.
"""

from __future__ import annotations

import math

import torch

from . import rope_triton


def _real_device() -> str | None:
    """Where the frequencies are computed: as before wherever the model is built, but on the CPU when it
    is built on the meta device (a part of a model materialised later: checkpoint.load_part), since
    they are no tensor a checkpoint fills."""
    return "cpu" if torch.get_default_device().type == "meta" else None


def default_inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=_real_device()) / rope_dim))


def yarn_inv_freq(rope_dim: int, theta: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, **_) -> torch.Tensor:
    def correction_dim(num_rotations: float) -> float:
        # dim index whose wavelength fits `num_rotations` times in the original context
        return rope_dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device=_real_device()) - low) / (high - low)).clamp(0, 1)
    extrapolation = default_inv_freq(rope_dim, theta)
    interpolation = extrapolation / factor
    keep = 1.0 - ramp  # 1 where the original frequency is kept
    return interpolation * (1 - keep) + extrapolation * keep


def inv_freq_for(rope_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    if scaling and scaling.get("rope_type", "default") == "yarn":
        return yarn_inv_freq(rope_dim, theta, **{k: v for k, v in scaling.items() if k != "rope_type"})
    return default_inv_freq(rope_dim, theta)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [*positions.shape, rope_dim // 2], fp32."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, triton: bool | None = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x in adjacent pairs, in fp32.

    cos/sin broadcast against x[..., :half]: callers insert the head axis themselves. triton: the
    caller's `triton_rope` switch (rope_triton.py: the trainer's kernel, where it applies).
    """
    if rope_triton.applies(x, cos, triton):
        return rope_triton.rope_with_grad(x, cos, sin)
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
