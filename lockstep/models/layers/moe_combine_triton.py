"""The routed experts' combine, and the dispatch's gradient, as Triton kernels (the trainer's MoE layers).

Experts.forward sorts its T x k rows by expert, runs the grouped GEMMs, puts the outputs back in
token order (an index_copy of [T k, H]) and adds each token's k outputs one at a time in slot order
(moe._combine: per slot, an fp32 product with the routing weight rounded to x's dtype, then an add
rounded to x's dtype, so the sum does not depend on the batch). Eager that is ~25 launches forward
over [T, H]-sized tensors, and the backward of its slot selections materialises a zeroed
[T, k, H] gradient per slot (6 fills and adds of [16,384, 6, 1,024] per MoE layer on the 1b config).

Here one kernel each way, reading the outputs where the grouped GEMMs left them (`slot_rows`
[T, k]: the row of ys holding token t's slot j, so the index_copy goes too):
    forward   out[t] = (((y_0 w_0)_r + (y_1 w_1)_r)_r + ...)_r      (_r: rounded to x's dtype)
    backward  d ys[slot_rows[t, j]] = (g[t] w[t, j])_r,   d w[t, j] = sum_h g[t, h] ys[slot_rows[t, j], h]
The forward and d ys are eager's bits (the same fp32 products and one rounding each, in the same
order); d w sums over h in another order (fp32 rounding). The dispatch that feeds the grouped GEMMs,
x[order // k], gets its gradient from the same slot_rows (`Dispatch`): d x[t] = sum_j d xs[slot_rows[t, j]].

A decode step (compiled, no autograd) combines through `combine_step` (`lockstep::combine_step`):
the same forward kernel, STEP_BLOCK columns a program, the shared expert's rows added last, and
optionally (FUSED_HC) the block's mHC combine into the streams in the same pass.

Where they run (`applies`): CUDA bf16 (or the interpreter with the switch set to True: the CPU tests,
bf16 or fp32), a gradient wanted, eager, and the `triton_combine` switch (kernel_switch.py;
TrainConfig.triton_combine), on by default on CUDA (an H200, 1b config: 1.10x the train step alone).
"""

from __future__ import annotations

import torch

from lockstep.triton_support import interpreted, trainer_kernel_takes

from . import grouped_gemm_triton as _gt
from . import stream_mix_triton
from .kernel_switch import grad_wanted

triton = _gt.triton
if triton is not None:
    import triton.language as tl


def applies(ys: torch.Tensor, weights: torch.Tensor, enabled: bool | None) -> bool:
    """Whether Experts.forward combines with these kernels (module docstring)."""
    if triton is None or torch.compiler.is_compiling() or not grad_wanted(ys, weights):
        return False
    return trainer_kernel_takes(ys, enabled)


def step_applies(ys: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether a decode step's combine can take `combine_step`: Triton present, ys bf16 or fp32 (the
    dtypes the kernel rounds to), fp32 routing weights."""
    return triton is not None and ys.dtype in (torch.bfloat16, torch.float32) and weights.dtype == torch.float32


def slot_rows(order: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """[T, k]: the row of the expert-sorted rows that holds token t's slot j (order inverted)."""
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=order.device)
    return rows.view(T, k)


def combine(ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ys [T k, H] in expert order, order [T k] (ys row i is token-slot order[i], as dispatch_order
    gives it), weights [T, k] -> [T, H] in ys's dtype: moe._combine of the unsorted outputs."""
    T, k = weights.shape
    return Combine.apply(ys, slot_rows(order, T, k), weights)


def dispatch(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """x [T, H], order [T k] -> x[order // k], the rows sorted by expert, with `Dispatch`'s gradient."""
    return Dispatch.apply(x, order, slot_rows(order, x.shape[0], k))


class Dispatch(torch.autograd.Function):
    """The dispatch's gather x[order // k] (each token k times): its gradient adds a token's k rows,
    d x[t] = sum_j g[slot_rows[t, j]] in fp32, slots in order, rounded once, in one kernel reading
    each row once. The eager autograd of the gather is an index_put with accumulation, which sorts
    the T k indices first: 0.31 ms at 16,384 x 6 rows of 1,024 on an H200, 0.064 ms here."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_rows)
        return x.index_select(0, order // slot_rows.shape[1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (rows,) = ctx.saved_tensors
        T, k = rows.shape
        g = g.contiguous()
        H = g.shape[1]
        d_x = g.new_empty(T, H)
        if T:
            block = min(1024, triton.next_power_of_2(H))
            _dispatch_backward_kernel[(T, triton.cdiv(H, block))](g, rows, d_x, H, K=k, BLOCK=block,
                                                                  BF16=g.dtype == torch.bfloat16,
                                                                  INTERPRETED=interpreted(), num_warps=4)
        return d_x, None, None


class Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ys: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ys, slot_rows, w = ys.contiguous(), slot_rows.contiguous(), weights.float().contiguous()
        T, k = slot_rows.shape
        H = ys.shape[1]
        out = ys.new_empty(T, H)
        if T:
            _combine_kernel[(T,)](ys, slot_rows, w, out, H, SHARED=False, **_no_streams(out, w), **_config(k, H, ys))
        ctx.save_for_backward(ys, slot_rows, w)
        ctx.weights_dtype = weights.dtype
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ys, slot_rows, w = ctx.saved_tensors
        T, k = slot_rows.shape
        H = ys.shape[1]
        g = g.contiguous()
        d_ys = torch.empty_like(ys)
        d_w = torch.empty(T, k, dtype=torch.float32, device=ys.device)
        if T:
            _combine_backward_kernel[(T,)](ys, slot_rows, w, g, d_ys, d_w, H, **_config(k, H, ys))
        return d_ys, None, d_w.to(ctx.weights_dtype)


# A decode step's combine kernel also does the block's mHC combine into the streams (combine_step's
# streams / post / comb; moe.MoE.forward's hc), where inductor's kernel after it took 1.7-2.2 us a
# layer. Measured on one H200 (1b config, batch 64, rollout_throughput.py --step-trace, 2026-12-04):
# the fused kernel 2.8-2.9 us a call against the plain combine's 2.0 plus inductor's combine, and a
# kernel less a layer (bf16 step 241 -> 233 kernels).
FUSED_HC = True

# columns a decode step's combine program takes: 8 bf16 a thread of one warp; 64 tokens x 1,024
# columns are 256 programs (one program a token, 1,024 columns, took 4.6 us in the 1b step)
STEP_BLOCK = 256


def _config(k: int, H: int, ys: torch.Tensor) -> dict:
    return dict(K=k, K_PAD=max(2, triton.next_power_of_2(k)), BLOCK=min(1024, triton.next_power_of_2(H)),
                BF16=ys.dtype == torch.bfloat16, INTERPRETED=interpreted(), num_warps=4)


def _no_streams(out: torch.Tensor, weights: torch.Tensor) -> dict:
    """The kernel's mHC arguments where it adds no streams (N_HC 0; the pointers are never read):
    every argument named at the launch, as inductor's launcher needs (tests/models/test_kernel_args.py)."""
    return dict(x_ptr=out, post_ptr=weights, comb_ptr=weights, N_HC=0)


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _bf16, _combined_stream = _gt._bf16, stream_mix_triton._combined_stream

    @triton.jit
    def _round(x, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """x (fp32) rounded to ys's dtype and back: the value an eager op in that dtype holds."""
        if BF16:
            y = _bf16(x, INTERPRETED).to(tl.float32)
        else:
            y = x
        return y

    @triton.jit
    def _hc_combine(y, t, cols, ok, x_ptr, post_ptr, comb_ptr, out_ptr, H, N_HC: tl.constexpr,
                    INTERPRETED: tl.constexpr):
        """mHC's combine of block output y (token t's columns `cols`, bf16 values in fp32) into its
        N_HC streams x [T, N_HC, H] (hyper_connection.hc_combine; stream_mix_triton._combined_stream)."""
        row = t + tl.zeros((1,), tl.int64)
        for k in tl.static_range(N_HC):
            new = _combined_stream(y[None, :], k, row, row >= 0, cols, ok[None, :], x_ptr, post_ptr, comb_ptr,
                                   N_HC * H, H, N_HC, INTERPRETED)
            tl.store(out_ptr + (t * N_HC + k) * H + cols[None, :], new, mask=ok[None, :])

    @triton.jit
    def _combine_kernel(ys_ptr, rows_ptr, w_ptr, out_ptr, H, K: tl.constexpr, K_PAD: tl.constexpr,
                        BLOCK: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr,
                        SHARED: tl.constexpr, x_ptr, post_ptr, comb_ptr, N_HC: tl.constexpr):
        """One token (program (t, c): its column blocks c, c + C, ...): its K slots added in order,
        each product and each sum rounded (moe._combine); SHARED: then its row of the shared
        expert's outputs (ys's rows past T K) added, rounded. The slots' loop is unrolled, so their
        loads are issued together (the adds wait on them one by one). N_HC > 0 (bf16): out is the
        mHC streams after the combine of the result into x's (`_hc_combine`), not the result."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        for h0 in range(tl.program_id(1) * BLOCK, H, tl.num_programs(1) * BLOCK):
            ok = h0 + cols < H
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for j in tl.static_range(K):
                row = tl.load(rows_ptr + t * K + j).to(tl.int64)
                y = tl.load(ys_ptr + row * H + h0 + cols, mask=ok, other=0.0).to(tl.float32)
                acc = _round(acc + _round(y * tl.load(w_ptr + t * K + j), BF16, INTERPRETED), BF16, INTERPRETED)
            if SHARED:
                y = tl.load(ys_ptr + (tl.num_programs(0) * K + t) * H + h0 + cols, mask=ok, other=0.0)
                acc = _round(acc + y.to(tl.float32), BF16, INTERPRETED)
            if N_HC > 0:
                _hc_combine(acc, t, h0 + cols, ok, x_ptr, post_ptr, comb_ptr, out_ptr, H, N_HC, INTERPRETED)
            else:
                tl.store(out_ptr + t * H + h0 + cols, acc, mask=ok)

    @torch.library.triton_op("lockstep::combine_step", mutates_args=())
    def combine_step(ys: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor, shared: bool,
                     streams: torch.Tensor | None = None, post: torch.Tensor | None = None,
                     comb: torch.Tensor | None = None) -> torch.Tensor:
        """A decode step's combine without autograd, for the compiled graph: ys [T k (+ T), H] in
        expert order (then the shared expert's T rows where `shared`), slot_rows [T, k] (as
        dispatch_order_triton.decode_dispatch gives them), weights [T, k] fp32 -> [T, H] in ys's
        dtype: moe._combine of the unsorted outputs (plus the shared rows, added last). With the
        block's mHC streams [T, n, H] (bf16) and its post [T, n] / comb [T, n, n] coefficients:
        -> the streams after hyper_connection.hc_combine of that result, [T, n, H]."""
        T, k = slot_rows.shape
        H = ys.shape[1]
        hc = _no_streams(ys, weights) if streams is None else dict(
            x_ptr=streams.contiguous(), post_ptr=post.contiguous(), comb_ptr=comb.contiguous(), N_HC=streams.shape[1])
        out = ys.new_empty(T, H) if streams is None else torch.empty_like(hc["x_ptr"])
        if T:  # a decode step's few tokens: STEP_BLOCK columns a program, for more programs
            config = {**_config(k, H, ys), "BLOCK": min(STEP_BLOCK, triton.next_power_of_2(H)), "num_warps": 1}
            torch.library.wrap_triton(_combine_kernel)[(T, triton.cdiv(H, config["BLOCK"]))](
                ys.contiguous(), slot_rows.contiguous(), weights.float().contiguous(), out, H, SHARED=shared,
                **hc, **config)
        return out

    @combine_step.register_fake
    def _(ys, slot_rows, weights, shared, streams=None, post=None, comb=None):
        return ys.new_empty(slot_rows.shape[0], ys.shape[1]) if streams is None else torch.empty_like(streams)

    @triton.jit
    def _dispatch_backward_kernel(g_ptr, rows_ptr, dx_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr,
                                  BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """One token's BLOCK columns: its K rows of g added in slot order in fp32, rounded once."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(rows_ptr + t * K + j).to(tl.int64)
            acc += tl.load(g_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        if BF16:
            tl.store(dx_ptr + t * H + cols, _bf16(acc, INTERPRETED), mask=ok)
        else:
            tl.store(dx_ptr + t * H + cols, acc, mask=ok)

    @triton.jit
    def _combine_backward_kernel(ys_ptr, rows_ptr, w_ptr, g_ptr, d_ys_ptr, d_w_ptr, H, K: tl.constexpr,
                                 K_PAD: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr,
                                 INTERPRETED: tl.constexpr):
        """One token: d ys of its K slots (g w, rounded) scattered to their rows; d w = sum_h g ys."""
        t = tl.program_id(0).to(tl.int64)
        slots = tl.arange(0, K_PAD)
        in_k = slots < K
        rows = tl.load(rows_ptr + t * K + slots, mask=in_k, other=0).to(tl.int64)
        w = tl.load(w_ptr + t * K + slots, mask=in_k, other=0.0)
        cols = tl.arange(0, BLOCK)
        dw = tl.zeros((K_PAD,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK):
            ok = h0 + cols < H
            both = in_k[:, None] & ok[None, :]
            g = tl.load(g_ptr + t * H + h0 + cols, mask=ok, other=0.0).to(tl.float32)
            at = rows[:, None] * H + h0 + cols[None, :]
            y = tl.load(ys_ptr + at, mask=both, other=0.0).to(tl.float32)
            tl.store(d_ys_ptr + at, _round(g[None, :] * w[:, None], BF16, INTERPRETED), mask=both)
            dw += tl.sum(g[None, :] * y, axis=1)
        tl.store(d_w_ptr + t * K + slots, dw, mask=in_k)
