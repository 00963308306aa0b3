"""The routed experts' grouped GEMM over packed fp4 weights (DeepSeek-V4's fp8-fp4 routed experts):
e2m1 codes two per byte, one e8m0 power-of-two scale per 1x32 block (quant/fp4.py's layout), read
by a Triton kernel that decodes them in registers: the first piece of serving the experts packed
(0.5 byte per parameter + 1 byte per 32) instead of as dequantised bf16 values.

    w_packed [G, N, K/2] uint8   element 2j of a row in the LOW nibble of byte j, 2j+1 in the high
    scale    [G, N, ceil(K/32)] e8m0 bytes (torch.float8_e8m0fnu viewed as uint8): 2 ** (byte - 127)

`grouped_mm_fp4(x, w_packed, scale, offs)` = x @ dequant(w[g]).T per group: the values the
emulated engine serves (serving_format.served_value) and the quantisation-aware trainer
reproduces. Its reference, `grouped_mm_fp4_reference`, dequantises and runs grouped_mm_reference.

The kernel follows grouped_gemm_triton.py's (a program owns one (group, BLOCK_N columns) tile and
walks its group's rows in BLOCK_M tiles; group bounds read from `offs` on the device, so CUDA graphs
capture it): per BLOCK_K step it loads a [BLOCK_K/2, BLOCK_N] tile of bytes, splits each byte's low
and high codes, multiplies each by its block's scale (exact: an e2m1 value times a power of two is
a bf16 value), and runs two bf16 dots with fp32 accumulation, the even columns of x against the low
codes and the odd ones against the high: no interleaving in registers. BLOCK_K is a multiple of 32,
so both codes of a byte share a scale. The result is rounded once to bf16; it differs from the
reference by summation order only (1 bf16 ulp; exact where the sums are exact).

packed_experts.PackedExperts serves fp4 experts through it (engine opt-in: EngineConfig.packed_experts).
"""

from __future__ import annotations

import os

import torch

from lockstep.quant.fp4 import FP4_BLOCK, dequantize_fp4_block
from lockstep.quant.scales import E8M0

from . import grouped_gemm_triton as _gt
from .grouped_gemm import grouped_mm_reference

triton = _gt.triton
if triton is not None:
    import triton.language as tl


def grouped_mm_fp4_reference(x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor,
                             counts: torch.Tensor) -> torch.Tensor:
    """Dequantise (to x's dtype, as the emulation holds the experts), then the grouped GEMM."""
    s = scale.view(E8M0) if scale.dtype == torch.uint8 else scale
    return grouped_mm_reference(x, dequantize_fp4_block(w_packed, s, x.dtype), counts)


def launch_config(N: int, K: int) -> dict:
    """By the weight's shape only (a row's result never depends on the other rows): 64 output
    columns, 128 of K per step (4 scale blocks), smaller for small dimensions; untuned."""
    return dict(BLOCK_N=min(64, max(16, triton.next_power_of_2(N))),
                BLOCK_K=min(128, max(FP4_BLOCK, triton.next_power_of_2(K))), num_warps=4, num_stages=3)


if triton is not None:
    # by name, not as _gt._dot: torch.compile re-creates a user kernel's source in a compile worker
    # from the JIT functions it references directly, so a module alias is undefined there
    _dot, _bf16 = _gt._dot, _gt._bf16

    @triton.jit
    def _e2m1(code):
        """Codes 0..15 -> fp32 values: magnitude 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign."""
        m = code & 7
        e = m >> 1
        pow2 = tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
        mag = tl.where(m < 2, m.to(tl.float32) * 0.5, (1.0 + (m & 1).to(tl.float32) * 0.5) * pow2)
        return tl.where((code & 8) != 0, -mag, mag)

    @triton.jit
    def _e8m0(byte):
        """e8m0 bytes -> 2 ** (byte - 127) in fp32; byte 0 (2 ** -127, subnormal) spelled out."""
        bits = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        return tl.where(byte == 0, 5.877471754111438e-39, bits)

    @triton.jit
    def _grouped_fp4_kernel(x_ptr, w_ptr, s_ptr, out_ptr, offs_ptr, N, K,
                            stride_xm, stride_xk, stride_wg, stride_wn, stride_wk, stride_sg, stride_sn, stride_sk,
                            stride_om, stride_on, INTERPRETED: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[rows of g, n tile] = x[rows of g] @ dequant(w[g, n tile])^T."""
        g = tl.program_id(0)
        end = tl.load(offs_ptr + g)
        start = tl.where(g > 0, tl.load(offs_ptr + tl.maximum(g - 1, 0)), 0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, BLOCK_K // 2)  # byte j of the step holds columns 2j and 2j + 1
        n_ok = (rn < N)[None, :]
        w_tile = w_ptr + g.to(tl.int64) * stride_wg + rn[None, :].to(tl.int64) * stride_wn + rj[:, None] * stride_wk
        s_tile = (s_ptr + g.to(tl.int64) * stride_sg + rn[None, :].to(tl.int64) * stride_sn
                  + (rj[:, None] * 2 // SCALE_BLOCK) * stride_sk)
        for m0 in range(start, end, BLOCK_M):  # no iteration for an empty group
            rm = m0 + tl.arange(0, BLOCK_M)
            m_ok = (rm < end)[:, None]
            x_even = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (2 * rj[None, :]) * stride_xk
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = k0 + 2 * rj < K  # K is even: the odd column of a valid byte is valid too
                a_lo = tl.load(x_even + k0 * stride_xk, mask=m_ok & k_ok[None, :], other=0.0)
                a_hi = tl.load(x_even + (k0 + 1) * stride_xk, mask=m_ok & k_ok[None, :], other=0.0)
                byte = tl.load(w_tile + (k0 // 2) * stride_wk, mask=n_ok & k_ok[:, None], other=0)
                s = _e8m0(tl.load(s_tile + (k0 // SCALE_BLOCK) * stride_sk, mask=n_ok & k_ok[:, None], other=127))
                w_lo = (_e2m1(byte & 0xF) * s).to(tl.bfloat16)
                w_hi = (_e2m1(byte >> 4) * s).to(tl.bfloat16)
                acc = _dot(a_lo, w_lo, acc, INTERPRETED)
                acc = _dot(a_hi, w_hi, acc, INTERPRETED)
            tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on,
                     _bf16(acc, INTERPRETED), mask=m_ok & n_ok)

    @torch.library.triton_op("lockstep::grouped_mm_fp4", mutates_args=())
    def grouped_mm_fp4(x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                       block_n: int = 0, block_k: int = 0) -> torch.Tensor:
        """x [M, K] bf16 sorted by group, w_packed [G, N, K/2] uint8, scale [G, N, ceil(K/32)] uint8
        (e8m0 bytes), offs [G] int32 cumulative row counts (rows past offs[-1] unwritten) -> [M, N]
        bf16. Nonzero keywords override `launch_config`."""
        G, N, half = w_packed.shape
        K = 2 * half
        cfg = launch_config(N, K)
        if block_n:
            cfg["BLOCK_N"] = block_n
        if block_k:
            cfg["BLOCK_K"] = block_k
        assert cfg["BLOCK_K"] % FP4_BLOCK == 0, "a K step must hold whole scale blocks"
        out = x.new_empty(x.shape[0], N)
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")
        torch.library.wrap_triton(_grouped_fp4_kernel)[(G, triton.cdiv(N, cfg["BLOCK_N"]))](
            x, w_packed, scale, out, offs, N, K, *x.stride(), *w_packed.stride(), *scale.stride(), *out.stride(),
            INTERPRETED=interpreted, SCALE_BLOCK=FP4_BLOCK, BLOCK_M=_gt.BLOCK_M, **cfg)
        return out

    @grouped_mm_fp4.register_fake
    def _(x, w_packed, scale, offs, *config):
        return x.new_empty(x.shape[0], w_packed.shape[1])
