"""The routed experts' grouped GEMM over packed fp8 experts (the fp8 format's experts): e4m3 bytes
[G, N, K] with one UE8M0 scale per 128x128 block of each expert (quant/fp8.py's layout, scale
[G, ceil(N/128), ceil(K/128)] fp32), dequantised in registers: 1 byte per parameter instead of 2.

`grouped_mm_fp8(x, w, scale, offs)` = x @ dequant(w[g]).T per group, the values the emulated
engine serves; its reference `grouped_mm_fp8_reference` dequantises and runs grouped_mm_reference.
The kernel is grouped_gemm_fp4.py's walk (a program per (group, BLOCK_N columns), the group's rows
in BLOCK_M tiles, bounds from `offs` on the device) with fp8_linear.py's tile dequantisation:
bytes bitcast to e4m3, times each row's block scale in fp32 (exact), to bf16, a bf16 dot with fp32
accumulation, rounded once. BLOCK_K divides 128: one scale column per step. The shared expert
rides along as grouped_gemm_triton's does (`shared=` (bytes, scale), groups past w's).
`grouped_swiglu_fp8` fuses the clamped SwiGLU into the gate_up GEMM as grouped_gemm_triton's
grouped_swiglu does (a gate and an up tile a step; FUSED_SWIGLU says whether the engine takes it).
"""

from __future__ import annotations

import torch

from lockstep.quant.fp8 import FP8_BLOCK, dequantize_fp8_block

from . import fp8_linear
from . import grouped_gemm_triton as _gt
from .grouped_gemm import grouped_mm_reference

triton = _gt.triton
if triton is not None:
    import triton.language as tl


# The decode step's gate_up GEMM with the clamped SwiGLU fused in (grouped_swiglu_fp8), where the
# step runs this kernel, then inductor's SwiGLU kernel (1.7 us a layer) over a written and re-read
# [M, 2F]. Off: slower. CPU-tested (bit for bit the bf16 fused kernel on the dequantised weights) and
# equal on an H200, but there (`benchmarks/moe_grouped_gemm.py --batch 64 --fp8`, 2026-12-04) 40.2 us
# a call against 26.8 for this kernel then the compiled SwiGLU; swept (`--fp8 --sweep`, 32 settings),
# its fastest was 25.5 us (64 columns, 2 warps, 3 stages) against 24.9 for the two kernels that run.
FUSED_SWIGLU = False


def grouped_mm_fp8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Dequantise (to x's dtype, as the emulation holds the experts), then the grouped GEMM."""
    return grouped_mm_reference(x, dequantize_fp8_block(w, scale, x.dtype), counts)


def launch_config(N: int, K: int, shared: bool = False) -> dict:
    """By the weight's shape only: 128 output columns, 128 of K per step, 2 warps; smaller for small
    sizes. Swept on one H200 (benchmarks/moe_grouped_gemm.py --fp8 --sweep, 1b shapes, batch 64, 32
    settings): gate_up 22.6 us against 24.2 with 64 columns and 4 warps, down 14.4 against 14.7 (the
    fastest there, 14.3, took 64 of K per step); 55-70% of the copy bandwidth, where the bf16
    kernel reads 90%. Transposing the product (the weight tile as the MMA's left operand, the scale
    applied to each step's product) was slower: 28.1 / 16.5 us. With the shared expert's groups
    (`shared`) 64 columns: its 4 more groups x 8 column tiles took the grid past two waves of
    programs (gate_up 32.3 us, down 18.9), 25.0 / 15.2 with 64 (one H200, 2026-12-04)."""
    return dict(BLOCK_N=min(64 if shared else 128, max(16, triton.next_power_of_2(N))),
                BLOCK_K=min(FP8_BLOCK[1], max(16, triton.next_power_of_2(K))), num_warps=2, num_stages=3)


if triton is not None:
    # by name, not as _gt._dot: torch.compile re-creates a user kernel's source in a compile worker
    # from the JIT functions it references directly, so a module alias is undefined there
    _dot, _result, _row_tile = _gt._dot, _gt._result, _gt._row_tile
    _dequantize, _dequantize_tile = fp8_linear._dequantize, fp8_linear._dequantize_tile  # the first: the second's

    @triton.jit
    def _dequant_tile(w_rows, s_rows, k0, k_ok, n_in, stride_wk, stride_sk, SCALE_BLOCK: tl.constexpr):
        """[BLOCK_K, BLOCK_N] of dequant(w)^T at k0: the e4m3 tile and its blocks' scales, loaded."""
        qb = tl.load(w_rows + k0 * stride_wk, mask=n_in[None, :] & k_ok[:, None], other=0)
        return _dequantize_tile(qb, tl.load(s_rows + (k0 // SCALE_BLOCK) * stride_sk, mask=n_in, other=0.0))

    @triton.jit
    def _grouped_fp8_kernel(x_ptr, w_ptr, s_ptr, ws_ptr, ss_ptr, out_ptr, offs_ptr, rows_ptr, limit, G_ROUTED, N, K,
                            stride_xm, stride_xk, stride_wg, stride_wn, stride_wk, stride_sg, stride_sn, stride_sk,
                            stride_om, stride_on, SWIGLU: tl.constexpr, GATHER: tl.constexpr,
                            INTERPRETED: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[rows of g, n tile] = x[rows of g] @ dequant(w[g, n tile])^T (ws, ss for g >= G_ROUTED);
        with SWIGLU, w[g] holds N gate rows then N up rows (each row reads its own block's scale) and
        out = swiglu_clamped(gate, up), rounded as grouped_gemm_triton's fused kernel rounds it. With
        GATHER, out's row m reads x's row rows[m]."""
        g = tl.program_id(0)
        end = tl.load(offs_ptr + g)
        start = tl.where(g > 0, tl.load(offs_ptr + tl.maximum(g - 1, 0)), 0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_in = rn < N
        w_g = w_ptr + g.to(tl.int64) * stride_wg
        s_g = s_ptr + g.to(tl.int64) * stride_sg
        if g >= G_ROUTED:
            w_g = ws_ptr
            s_g = ss_ptr
        w_tile = w_g + rn[None, :].to(tl.int64) * stride_wn + rk[:, None] * stride_wk
        s_row = s_g + (rn // SCALE_BLOCK) * stride_sn
        up_tile = w_tile + tl.cast(N, tl.int64) * stride_wn  # the up rows lie N rows further on
        up_s_row = s_g + ((rn + N) // SCALE_BLOCK) * stride_sn
        for m0 in range(start, end, BLOCK_M):  # no iteration for an empty group
            rm = m0 + tl.arange(0, BLOCK_M)
            m_ok = (rm < end)[:, None]
            x_tile = _row_tile(x_ptr, rows_ptr, rm, end, rk, stride_xm, stride_xk, GATHER)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = k0 + rk < K
                a = tl.load(x_tile + k0 * stride_xk, mask=m_ok & k_ok[None, :], other=0.0)
                w = _dequant_tile(w_tile, s_row, k0, k_ok, n_in, stride_wk, stride_sk, SCALE_BLOCK)
                acc = _dot(a, w, acc, INTERPRETED)
                if SWIGLU:
                    w_up = _dequant_tile(up_tile, up_s_row, k0, k_ok, n_in, stride_wk, stride_sk, SCALE_BLOCK)
                    acc_up = _dot(a, w_up, acc_up, INTERPRETED)
            tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on,
                     _result(acc, acc_up, limit, SWIGLU, INTERPRETED), mask=m_ok & n_in[None, :])

    @torch.library.triton_op("lockstep::grouped_mm_fp8", mutates_args=())
    def _grouped_mm_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                        block_n: int = 0, block_k: int = 0, num_warps: int = 0, num_stages: int = 0,
                        shared_w: torch.Tensor | None = None, shared_scale: torch.Tensor | None = None,
                        limit: float = 0.0, swiglu: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
        G, N, K = w.shape
        N = N // 2 if swiglu else N  # the output's columns: gate rows, then as many up rows
        cfg = launch_config(N, K, shared_w is not None)
        for key, value in (("BLOCK_N", block_n), ("BLOCK_K", block_k), ("num_warps", num_warps),
                           ("num_stages", num_stages)):
            cfg[key] = value or cfg[key]  # 0: the default
        assert FP8_BLOCK[1] % cfg["BLOCK_K"] == 0, "a K step must lie within one scale column"
        shared_w = _gt.shared_operand("the shared expert's fp8 bytes", shared_w, w)
        shared_scale = _gt.shared_operand("the shared expert's fp8 scale", shared_scale, scale)
        out = x.new_empty(x.shape[0] if rows is None else rows.shape[0], N)
        torch.library.wrap_triton(_grouped_fp8_kernel)[(offs.shape[0], triton.cdiv(N, cfg["BLOCK_N"]))](
            x, w, scale, shared_w, shared_scale, out, offs, offs if rows is None else rows.contiguous(), limit, G, N,
            K, *x.stride(), *w.stride(), *scale.stride(), *out.stride(), SWIGLU=swiglu, GATHER=rows is not None,
            INTERPRETED=_gt.interpreted(), SCALE_BLOCK=FP8_BLOCK[0], BLOCK_M=_gt.BLOCK_M, **cfg)
        return out

    @_grouped_mm_fp8.register_fake
    def _(x, w, scale, offs, *config, shared_w=None, shared_scale=None, limit=0.0, swiglu=False, rows=None):
        return x.new_empty(x.shape[0] if rows is None else rows.shape[0], w.shape[1] // 2 if swiglu else w.shape[1])


def grouped_mm_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                   block_n: int = 0, block_k: int = 0, num_warps: int = 0, num_stages: int = 0,
                   shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 sorted by group, w [G, N, K] float8_e4m3fn, scale [G, ceil(N/128), ceil(K/128)]
    fp32, offs [G] int32 cumulative row counts (rows past offs[-1] unwritten) -> [M, N] bf16.
    The launch settings override launch_config's (0: its value; benchmarks/moe_grouped_gemm.py --fp8 sweeps them).
    shared: the shared expert's (bytes [N, K], scale), for the groups of offs past G
    (grouped_gemm_triton.with_shared_groups). rows [M] (int64): row m reads x[rows[m]] (x any [T, K];
    grouped_gemm_triton.grouped_swiglu's gather)."""
    return _call_op(x, w, scale, offs, (block_n, block_k, num_warps, num_stages), shared, 0.0, False, rows)


def grouped_swiglu_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, limit: float,
                       block_n: int = 0, block_k: int = 0, num_warps: int = 0, num_stages: int = 0,
                       shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
    """grouped_mm_fp8 over packed gate_up experts w [G, 2F, K] (gate rows, then up) with the clamped
    SwiGLU fused in -> swiglu_clamped(gate, up, limit) [M, F] bf16: the bits of the bf16 fused kernel
    (grouped_gemm_triton.grouped_swiglu) on the dequantised weights. Arguments as grouped_mm_fp8's."""
    return _call_op(x, w, scale, offs, (block_n, block_k, num_warps, num_stages), shared, limit, True, rows)


def _call_op(x, w, scale, offs, launch: tuple, shared, limit: float, swiglu: bool, rows=None) -> torch.Tensor:
    """lockstep::grouped_mm_fp8 on the e4m3 tensors' bytes (the op takes uint8)."""
    shared_w, shared_scale = (None, None) if shared is None else (shared[0].view(torch.uint8), shared[1])
    return torch.ops.lockstep.grouped_mm_fp8(x, w.view(torch.uint8), scale, offs, *launch, shared_w, shared_scale,
                                             limit, swiglu, rows)
