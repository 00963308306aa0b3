"""RMSNorm with gradients as Triton kernels: the trainer's norms (norm.py's RMSNorm and rms_norm).

Forward: the fixed-order kernel (fixed_order_rmsnorm.py): one program per row, y = (w *) x r,
r = rsqrt(mean(x^2) + eps) in fp32, one rounding to x's dtype; eager's values to 1 ulp of it.
Backward, with u = x r (the normalised row) and gu = g w (g alone when unweighted):
    d x = r (gu - u mean(gu u)) = r (gu - x r c),  c = r sum(gu x) / D   (`_rms_norm_dx_kernel`, per row)
    d w = sum over rows of g u                                         (`_rms_norm_dw_kernel`)
r is recomputed from x with the forward's own helper (the same bits), so the backward keeps only
x (which the caller keeps anyway) and w: eager's autograd kept x cast up to fp32 as well
([tokens, D] x 4 bytes per norm). One launch forward and two backward where eager ran ~6 and ~10
element-wise kernels (the cast, the square, the mean, rsqrt, two products, the cast back; and
their gradients).

d w: where a row fits one column tile (D <= 1024: every norm of the 1b config), one kernel does
both (`_rms_norm_backward_kernel`): each program walks a share of the rows (`fused_launch`: by the
shape only), writes each row's d x as the d x kernel does (its expressions: the same bits under the
interpreter; compiled, FMA contraction may differ at fp32 rounding) and sums its rows' g u in
registers, so x and g are read once where the two kernels read them twice (~96 of ~160 MB a
[16,384, 1024] norm). Wider rows take the second kernel: each program sums a column tile over a
share of the rows, BLOCK_R rows at a time (`dw_launch`). Either way torch adds the shares in index
order (no atomics: the same bits every run, on any GPU).

Where it runs (`applies`): CUDA bf16 (or the interpreter with the switch set to True: the CPU
tests, bf16 or fp32), a gradient wanted, eager, not over whole rows, and the `triton_norm` switch
(kernel_switch.py; TrainConfig.triton_norm), on by default on CUDA (an H200, 1b config: 0.99x the
train step alone, 1.16x with the other four kernels on).
"""

from __future__ import annotations

import torch

from lockstep.triton_support import interpreted, trainer_kernel_takes

from . import grouped_gemm_triton as _gt
from .fixed_order_rmsnorm import fixed_order_rms_norm, launch_config
from .kernel_switch import grad_wanted
from .whole_rows import in_whole_rows

triton = _gt.triton
if triton is not None:
    import triton.language as tl

    from .fixed_order_rmsnorm import _row_inverse_rms

# d w's launch (dw_launch): tiles of 32 rows x up to 256 columns, about 512 programs. The first
# form, 64 shares each summing its rows one at a time, was bound by the latency of that serial
# loop: 76 us a call on an H200 (1b config, 16,384 rows; 2.98 ms of a 107 ms train step).
DW_BLOCK_R, DW_BLOCK_D, DW_PROGRAMS = 32, 256, 512
# the one-kernel backward (fused_launch): about this many programs, each a share of whole rows
FUSED_PROGRAMS = 1024


def applies(x: torch.Tensor, weight: torch.Tensor | None, enabled: bool | None) -> bool:
    """Whether norm.py's RMSNorm / rms_norm take these kernels (module docstring)."""
    if triton is None or in_whole_rows() or torch.compiler.is_compiling():
        return False
    return trainer_kernel_takes(x, enabled) and grad_wanted(x, *([] if weight is None else [weight]))


def trained_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dim (weight [D] or None) with the Triton backward."""
    return TrainedRMSNorm.apply(x, weight, eps)


class TrainedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return fixed_order_rms_norm(x, weight, eps)  # no gradient mode in here: the kernel runs

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(x, weight, g, ctx.eps, weight is not None and ctx.needs_input_grad[1])
        return dx, dw, None


def dw_launch(R: int, D: int) -> tuple[dict, int, int]:
    """(tile config, shares, rows per share) of d w, by the shape only (so the same bits on any
    GPU): BLOCK_R rows x BLOCK_D columns per step, the rows split into shares of whole steps so
    that the grid has about DW_PROGRAMS programs."""
    cfg = dict(BLOCK_R=DW_BLOCK_R, BLOCK_D=min(DW_BLOCK_D, max(16, triton.next_power_of_2(D))), num_warps=4)
    steps = max(triton.cdiv(R, cfg["BLOCK_R"]), 1)
    col_tiles = triton.cdiv(D, cfg["BLOCK_D"])
    per_share = triton.cdiv(steps, min(steps, max(DW_PROGRAMS // col_tiles, 1))) * cfg["BLOCK_R"]
    return cfg, triton.cdiv(max(R, 1), per_share), per_share


def fused_launch(R: int) -> tuple[int, int]:
    """(programs, rows per program) of the one-kernel backward, by the row count only (so the same
    bits on any GPU): about FUSED_PROGRAMS programs of whole rows, the last one's share ragged."""
    rows = -(-R // FUSED_PROGRAMS)  # Python's ceil-division: triton.cdiv is a JIT function, ~4 us a call
    return -(-R // rows), rows


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor | None, g: torch.Tensor, eps: float,
                      with_dw: bool, one_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d x, d w or None) of y = RMSNorm(x) (* weight) for the gradient g of y (module docstring).
    one_kernel False: d x and d w by their own kernels even where a row fits one tile (the benchmark's
    comparison)."""
    D = x.shape[-1]
    x2, g2 = x.reshape(-1, D).contiguous(), g.reshape(-1, D).contiguous()
    R = x2.shape[0]
    dx = torch.empty_like(x2)
    w = x2 if weight is None else weight.contiguous()
    cfg = launch_config(D)
    if one_kernel and with_dw and R and D <= cfg["BLOCK"]:  # a row in one tile: d x and d w's shares in one pass
        programs, rows = fused_launch(R)
        partial = torch.empty(programs, D, dtype=torch.float32, device=x.device)
        _rms_norm_backward_kernel[(programs,)](x2, w, g2, dx, partial, R, D, rows, float(D), eps,
                                               BF16=x.dtype == torch.bfloat16, INTERPRETED=interpreted(), **cfg)
        return dx.view(x.shape), partial.sum(0).to(weight.dtype)  # the shares added in index order
    r = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        _rms_norm_dx_kernel[(R,)](x2, w, g2, dx, r, D, float(D), eps, HAS_WEIGHT=weight is not None,
                                  BF16=x.dtype == torch.bfloat16, INTERPRETED=interpreted(), **cfg)
    dw = None
    if with_dw:
        cfg, shares, per_share = dw_launch(R, D)
        partial = torch.empty(shares, D, dtype=torch.float32, device=x.device)
        _rms_norm_dw_kernel[(triton.cdiv(D, cfg["BLOCK_D"]), shares)](x2, g2, r, partial, R, D, per_share, **cfg)
        dw = partial.sum(0).to(weight.dtype)  # the shares added in index order
    return dx.view(x.shape), dw


if triton is not None:
    _bf16 = _gt._bf16  # by name: torch.compile's compile worker cannot resolve a module alias

    @triton.jit
    def _normed_rows(x, w, D, eps, WEIGHTED: tl.constexpr):
        """norm.rms_norm (RMSNorm where WEIGHTED) of rows x [R, C] held in registers (fp32, zeros past D),
        in fp32, not rounded: x rsqrt(mean x^2 + eps), times w [C] (fp32). The decode kernels' norms
        (qk_norm_rope_triton, hc_pre_triton); the sum of squares a tree (tl.sum), rsqrt libdevice's."""
        y = x * tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        if WEIGHTED:
            y = w[None, :] * y
        return y

    @triton.jit
    def _gu_x_tile(x_row, g_row, w_ptr, d0, cols, D, HAS_WEIGHT: tl.constexpr):
        """The tile at d0 of a row: which columns exist, g w (g alone unweighted) and x, in fp32."""
        ok = d0 + cols < D
        gu = tl.load(g_row + d0 + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            gu = gu * tl.load(w_ptr + d0 + cols, mask=ok, other=0.0).to(tl.float32)
        return ok, gu, tl.load(x_row + d0 + cols, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _dx_tile(gu, x, r, c, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """d x = r (g w - x r c) of a tile, rounded to bf16 where BF16: both backward kernels' d x."""
        dx = r * (gu - x * r * c)
        if BF16:
            dx = _bf16(dx, INTERPRETED)
        return dx

    @triton.jit
    def _rms_norm_dx_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, r_ptr, D, d_float, eps, HAS_WEIGHT: tl.constexpr,
                            BF16: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """One row: r (the forward's), c = r sum(g w x) / D, d x = r (g w - x r c); r kept for d w."""
        row = tl.program_id(0).to(tl.int64)
        x_row, g_row, dx_row = x_ptr + row * D, g_ptr + row * D, dx_ptr + row * D
        cols = tl.arange(0, BLOCK)
        r = _row_inverse_rms(x_row, 1, D, d_float, eps, INTERPRETED, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK):
            _, gu, x = _gu_x_tile(x_row, g_row, w_ptr, d0, cols, D, HAS_WEIGHT)
            acc += gu * x
        c = r * tl.sum(acc, axis=0) / tl.cast(d_float, tl.float32)
        for d0 in range(0, D, BLOCK):  # the row read again: its tiles are not kept between the passes
            ok, gu, x = _gu_x_tile(x_row, g_row, w_ptr, d0, cols, D, HAS_WEIGHT)
            tl.store(dx_row + d0 + cols, _dx_tile(gu, x, r, c, BF16, INTERPRETED), mask=ok)
        tl.store(r_ptr + row, r)

    @triton.jit
    def _rms_norm_backward_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, partial_ptr, R, D, ROWS, d_float, eps,
                                  BF16: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """Rows [p ROWS, (p + 1) ROWS) of a weighted norm whose row fits one tile (D <= BLOCK): each
        row's d x as `_rms_norm_dx_kernel` computes it (the same expressions), and
        partial[p] = the sum over the rows, in order, of g x r (d w's share), kept in registers."""
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # read once for all the rows
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        first = tl.program_id(0).to(tl.int64) * ROWS
        for row in range(first, tl.minimum(first + ROWS, R)):
            x_row = x_ptr + row * D
            g = tl.load(g_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)  # in flight during r's sum
            r = _row_inverse_rms(x_row, 1, D, d_float, eps, INTERPRETED, BLOCK)
            x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            gu = g * w
            c = r * tl.sum(gu * x, axis=0) / tl.cast(d_float, tl.float32)
            tl.store(dx_ptr + row * D + cols, _dx_tile(gu, x, r, c, BF16, INTERPRETED), mask=ok)
            dw += g * (x * r)
        tl.store(partial_ptr + tl.program_id(0).to(tl.int64) * D + cols, dw, mask=ok)

    @triton.jit
    def _rms_norm_dw_kernel(x_ptr, g_ptr, r_ptr, partial_ptr, R, D, ROWS_PER_SHARE, BLOCK_R: tl.constexpr,
                            BLOCK_D: tl.constexpr):
        """partial[share, cols] = sum over the share's rows of g x r (one column tile), BLOCK_R rows
        a step: each step's loads are independent of the last's, so they overlap."""
        cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        first = tl.program_id(1) * ROWS_PER_SHARE
        last = tl.minimum(first + ROWS_PER_SHARE, R)
        acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        for r0 in range(first, last, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_ok = rows < last
            at = rows[:, None].to(tl.int64) * D + cols[None, :]  # offsets in 64 bits
            mask = row_ok[:, None] & ok[None, :]
            u = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32) * tl.load(r_ptr + rows, mask=row_ok,
                                                                                      other=0.0)[:, None]
            acc += tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32) * u
        tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * D + cols, tl.sum(acc, axis=0), mask=ok)
