"""The routed experts' grouped GEMMs at decode as Triton kernels, registered as the custom ops
`lockstep::grouped_mm` (x @ w[g]^T per group) and `lockstep::grouped_swiglu` (the first expert
GEMM with the clamped SwiGLU fused in).

Why: a decode step has a few rows per expert (64 tokens x top-6 over 64 experts: ~6), so its
expert GEMMs are a read of every expert's weights (~200 MB per layer of the 1b config), bound by
memory bandwidth; torch._grouped_mm (CUTLASS) reached ~50% of an H200's there. Here a program
owns one (group, BLOCK_N output columns) tile and streams that slice of w[g] over K in long
pipelined runs, once per BLOCK_M = 16 rows of its group (one tile, usually; a hot expert's
further tiles re-read the slice from L2). Group bounds are read from `offs` on the device: no
host read of the counts, so CUDA graphs capture the ops and torch.compile keeps each as one
opaque kernel; programs of empty groups do nothing. Fusing the SwiGLU saves writing and
re-reading the [M, 2F] gate/up product and the activation's element-wise kernels.
The shared expert can ride along (`shared=`, moe.Experts.folds_shared): `offs` then lists more
groups than `w` holds, and the groups past w's read the shared expert's weight instead, the
step's T tokens after the routed rows split into a few groups (`with_shared_groups`) so that
they run side by side: one kernel per expert GEMM serves both, where the shared expert's
own GEMMs and SwiGLU were three more launches per layer.

Numerics: fp32 accumulation (tl.dot) over bf16 inputs, each output rounded once to bf16, as
torch._grouped_mm; the sums run in another order, so the two agree to 1 bf16 ulp, not bitwise.
A row's result does not depend on the other rows (the launch config depends on N and K only).
The fused epilogue rounds where eager bf16 `moe.swiglu_clamped` does: gate and up to bf16; the
clamps with the limit rounded to bf16 and NaN kept (torch's clamp); silu in fp32 as
x / (1 + exp(-x)) with libdevice's expf and IEEE division (CUDA torch's formula and functions:
Triton's `tl.exp` and `/` are approximations on GPUs), rounded to bf16; the product in fp32,
rounded to bf16. Under the interpreter (the CPU tests) three of its gaps are bridged: it has no
libdevice (numpy's exp there, which matches torch's CPU silu on every bf16 input), its bf16
tl.dot multiplies the raw bits as integers (tiles cast to fp32 there, exactly), and its
fp32 -> bf16 cast truncates (rounded to nearest even by hand there).

Forward only (no autograd registered): callers use the ops with gradients off
(grouped_gemm.triton_experts). No triton.autotune (it would benchmark during CUDA-graph
capture): `launch_config` picks by shape, and keyword arguments override it (the benchmark's
sweep, benchmarks/moe_grouped_gemm.py). Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from lockstep.triton_support import interpreted, load_triton

triton = load_triton()  # None: grouped_gemm.py's paths are always there
if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

BLOCK_M = 16  # rows per tile: tl.dot's minimum; a decode step has ~6 rows per expert
# A program walks its group's row tiles one after another, so past a few tiles per group
# (prefill) CUTLASS's large tiles win: Experts takes these kernels at decode steps only (moe.py).


def forward_kernel_runs(x: torch.Tensor) -> bool:
    """A forward-only kernel of this package (the whole-rows ones) can take x: Triton present, bf16 or
    fp32, on CUDA (or the interpreter), no gradient wanted through it."""
    if triton is None or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return x.is_cuda or interpreted()


def available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernels can compute x [M, K] @ w[g]^T, w [G, N, K]: Triton present, bf16, K matching."""
    return (triton is not None and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and x.dim() == 2 and w.dim() == 3 and x.shape[1] == w.shape[2])


def launch_config(N: int, K: int, fused: bool) -> dict:
    """Memory-bound defaults for H100/H200, by the weight's shape only (a row's result never
    depends on the batch): 128 of K per step, 4 warps, 3 pipeline stages; 64 output columns per
    program, 32 fused (it loads a gate and an up tile per step). Swept on an H200 at the 1b
    config's decode shapes (benchmarks/moe_grouped_gemm.py --sweep, batch 64): fused 34.6 us
    (64 columns: 36.8), plain 19.2 us (4 stages: 20.5). Small dimensions shrink the blocks."""
    return dict(BLOCK_N=min(32 if fused else 64, max(16, triton.next_power_of_2(N))),
                BLOCK_K=min(128, max(16, triton.next_power_of_2(K))),
                num_warps=4, num_stages=3)


SHARED_GROUPS = 4  # the shared expert's rows split into this many groups (with_shared_groups)


def with_shared_groups(offs: torch.Tensor, shared_rows) -> torch.Tensor:
    """offs [G] of the routed rows, then the shared expert's `shared_rows` rows (stored after them) as
    SHARED_GROUPS groups of near-equal size: a program walks its group's row tiles one after another,
    so one group of a decode step's T rows would make its programs ~T / BLOCK_M times longer than
    the routed experts' (~T k / E rows each). A fixed group count, not T / BLOCK_M: a compiled
    decode step's T is a symbol, and a tensor whose length depends on it did not compile."""
    ends = torch.arange(1, SHARED_GROUPS + 1, device=offs.device) * shared_rows // SHARED_GROUPS
    return torch.cat([offs, offs[-1:] + ends.to(offs.dtype)])


def laid_out_as_one(t: torch.Tensor, stacked: torch.Tensor) -> bool:
    """t has the dtype, shape and strides of one entry of `stacked`: the kernels read a shared
    expert's tensor with a routed expert's strides."""
    return t.dtype == stacked.dtype and t.shape == stacked.shape[1:] and t.stride() == stacked.stride()[1:]


def shared_operand(what: str, shared: torch.Tensor | None, stacked: torch.Tensor) -> torch.Tensor:
    """The kernel argument for the shared expert's tensor: `shared`, checked to be laid out as one
    entry of the routed experts' `stacked` (a clear error otherwise), or, without one, `stacked`
    itself (a pointer the kernel never reads: every group is a routed expert's)."""
    if shared is None:
        return stacked
    if not laid_out_as_one(shared, stacked):
        raise ValueError(f"{what} {tuple(shared.shape)} {shared.dtype} (strides {shared.stride()}) must be laid "
                         f"out as one routed expert's {tuple(stacked.shape[1:])} {stacked.dtype} "
                         f"(strides {stacked.stride()[1:]})")
    return shared


def _launch(x, w, offs, limit, N, fused, overrides, shared, rows=None):
    """out [M, N] from the kernel; `overrides` (BLOCK_N, BLOCK_K, num_warps, num_stages) are the
    ops' keywords, 0 for the default; `shared` the weight of the groups past w's (module docstring);
    `rows` [M]: row m is x[rows[m]] (the dispatch's gather read in the kernel), else x's row m."""
    K = x.shape[1]
    cfg = launch_config(N, K, fused)
    cfg.update({key: value for key, value in zip(cfg, overrides) if value})
    shared = shared_operand("the shared expert's weight", shared, w)
    out = x.new_empty(x.shape[0] if rows is None else rows.shape[0], N)
    grid = (offs.shape[0], triton.cdiv(N, cfg["BLOCK_N"]))
    torch.library.wrap_triton(_grouped_kernel)[grid](
        x, w, shared, out, offs, offs if rows is None else rows.contiguous(), limit, w.shape[0], N, K, *x.stride(),
        *w.stride(), *out.stride(), SWIGLU=fused, GATHER=rows is not None, INTERPRETED=interpreted(), BLOCK_M=BLOCK_M,
        EVEN_K=K % cfg["BLOCK_K"] == 0, **cfg)
    return out


if triton is not None:

    @triton.jit
    def _load(ptrs, ok, k_ok, EVEN_K: tl.constexpr):
        # zero past the group's rows, past N and, unless BLOCK_K divides K, past K
        if EVEN_K:
            mask = ok
        else:
            mask = ok & k_ok
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _dot(a, b, acc, INTERPRETED: tl.constexpr):
        if INTERPRETED:
            # not its tl.dot: that multiplies bf16 tiles as the integers of their bits, and is numpy's
            # matmul, whose BLAS sums an output in an order that depends on its place in the tile
            # (on AVX2 machines): products summed over k in index order, as each MMA lane's are
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _bf16(x, INTERPRETED: tl.constexpr):
        # round to nearest even; the interpreter's own cast truncates
        if INTERPRETED:
            y = _bf16_bits(x)
        else:
            y = x.to(tl.bfloat16)
        return y

    @triton.jit
    def _bf16_bits(x):
        """fp32 -> bf16, nearest even, in integer ops. Also where a rounding must survive the GPU
        compiler: it narrows a cast product of bf16 values and a following add of bf16 values to bf16
        ops, then contracts them into one fma.rn.bf16 (a single rounding where eager rounds twice)."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = tl.where(x == x, bits + 0x7FFF + ((bits >> 16) & 1), bits)  # NaN stays NaN
        return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _swiglu_clamped(acc_gate, acc_up, limit, INTERPRETED: tl.constexpr):
        # eager bf16 swiglu_clamped's roundings; torch's clamp rounds its bound to bf16, keeps NaN
        lim = _bf16(tl.cast(limit, tl.float32), INTERPRETED).to(tl.float32)
        gate = _bf16(acc_gate, INTERPRETED).to(tl.float32)
        gate = tl.minimum(gate, lim, propagate_nan=tl.PropagateNan.ALL)
        up = _bf16(acc_up, INTERPRETED).to(tl.float32)
        up = tl.maximum(up, -lim, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(up, lim, propagate_nan=tl.PropagateNan.ALL)
        if INTERPRETED:  # which has no libdevice
            e = tl.exp(-gate)
        else:
            e = libdevice.exp(-gate)
        silu = _bf16(tl.math.div_rn(gate, 1.0 + e), INTERPRETED).to(tl.float32)
        return _bf16(silu * up, INTERPRETED)

    @triton.jit
    def _result(acc, acc_up, limit, SWIGLU: tl.constexpr, INTERPRETED: tl.constexpr):
        """A grouped kernel's output tile: swiglu_clamped(gate, up) where SWIGLU, else the product,
        rounded to bf16 (this kernel's and grouped_gemm_fp8's)."""
        if SWIGLU:
            result = _swiglu_clamped(acc, acc_up, limit, INTERPRETED)
        else:
            result = _bf16(acc, INTERPRETED)
        return result

    @triton.jit
    def _row_tile(x_ptr, rows_ptr, rm, end, rk, stride_xm, stride_xk, GATHER: tl.constexpr):
        """The [BLOCK_M, BLOCK_K] pointers of a group's rows rm (< end) at the first K step: x's rows
        rm, or with GATHER x's rows rows[rm] (the dispatch's gather read in place)."""
        if GATHER:
            src = tl.load(rows_ptr + rm, mask=rm < end, other=0).to(tl.int64)
        else:
            src = rm.to(tl.int64)
        return x_ptr + src[:, None] * stride_xm + rk[None, :] * stride_xk

    @triton.jit
    def _grouped_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, offs_ptr, rows_ptr, limit, G_ROUTED, N, K,
                        stride_xm, stride_xk, stride_wg, stride_wn, stride_wk, stride_om, stride_on,
                        SWIGLU: tl.constexpr, GATHER: tl.constexpr, INTERPRETED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """out[rows of g, n tile] = x[rows of g] @ w[g, n tile]^T (ws for g >= G_ROUTED: the shared
        expert); with SWIGLU, w[g] holds N gate rows then N up rows and out = swiglu_clamped(gate, up).
        With GATHER, out's row m reads x's row rows[m]."""
        g = tl.program_id(0)
        end = tl.load(offs_ptr + g)
        start = tl.where(g > 0, tl.load(offs_ptr + tl.maximum(g - 1, 0)), 0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = (rn < N)[None, :]
        # w[g]'s slice as a [BLOCK_K, BLOCK_N] tile of w[g]^T; the up rows lie N rows further on
        w_g = w_ptr + g.to(tl.int64) * stride_wg
        if g >= G_ROUTED:
            w_g = ws_ptr
        w_tile = w_g + rn[None, :].to(tl.int64) * stride_wn + rk[:, None] * stride_wk
        up_shift = tl.cast(N, tl.int64) * stride_wn
        for m0 in range(start, end, BLOCK_M):  # no iteration for an empty group
            rm = m0 + tl.arange(0, BLOCK_M)
            m_ok = (rm < end)[:, None]
            x_tile = _row_tile(x_ptr, rows_ptr, rm, end, rk, stride_xm, stride_xk, GATHER)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = k0 + rk < K
                a = _load(x_tile + k0 * stride_xk, m_ok, k_ok[None, :], EVEN_K)
                acc = _dot(a, _load(w_tile + k0 * stride_wk, n_ok, k_ok[:, None], EVEN_K), acc, INTERPRETED)
                if SWIGLU:
                    b_up = _load(w_tile + up_shift + k0 * stride_wk, n_ok, k_ok[:, None], EVEN_K)
                    acc_up = _dot(a, b_up, acc_up, INTERPRETED)
            tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on,
                     _result(acc, acc_up, limit, SWIGLU, INTERPRETED), mask=m_ok & n_ok)

    @torch.library.triton_op("lockstep::grouped_mm", mutates_args=())
    def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, block_n: int = 0, block_k: int = 0,
                   num_warps: int = 0, num_stages: int = 0, shared: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] bf16 sorted by group, w [G, N, K], offs [G] int32 cumulative row counts (as
        torch._grouped_mm takes them; rows past offs[-1] are left unwritten) -> [M, N] bf16, row
        block g times w[g]^T. Nonzero keywords override `launch_config`. With `shared` [N, K], offs
        may list groups past G (`with_shared_groups`): those rows take shared^T."""
        return _launch(x, w, offs, 0.0, w.shape[1], False, (block_n, block_k, num_warps, num_stages), shared)

    @torch.library.triton_op("lockstep::grouped_swiglu", mutates_args=())
    def grouped_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, offs: torch.Tensor, limit: float,
                       block_n: int = 0, block_k: int = 0, num_warps: int = 0, num_stages: int = 0,
                       shared: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] bf16 sorted by group, w_gate_up [G, 2F, K] (gate rows, then up), offs and shared
        ([2F, K]) as in grouped_mm -> swiglu_clamped(gate, up, limit) [M, F] bf16, rounded as eager bf16 does.
        With rows [M] (int64), x is any [T, K] and row m of the product reads x[rows[m]]: a decode
        step's dispatch gather, read by the kernel where inductor ran one more (1.5-1.7 us a layer)."""
        return _launch(x, w_gate_up, offs, limit, w_gate_up.shape[1] // 2, True,
                       (block_n, block_k, num_warps, num_stages), shared, rows)

    # Shapes for torch.compile's tracing, written out: the default (the body run on fake tensors)
    # would launch the kernel itself under the interpreter, which wrap_triton leaves unwrapped.
    @grouped_mm.register_fake
    def _(x, w, offs, *config, shared=None):
        return x.new_empty(x.shape[0], w.shape[1])

    @grouped_swiglu.register_fake
    def _(x, w_gate_up, offs, limit, *config, shared=None, rows=None):
        return x.new_empty(x.shape[0] if rows is None else rows.shape[0], w_gate_up.shape[1] // 2)
