"""Manifold-constrained hyper-connections (mHC): hc_mult residual streams per token.

Around each sub-block, from the flattened streams x = X.flatten() (fp32, unweighted RMSNorm):
    m = fn @ x  -> pre (n), post (n), comb (n*n)
    pre  = sigmoid(scale0 * m_pre + base_pre) + eps        collapses X into the block input
    post = 2 * sigmoid(scale1 * m_post + base_post)        spreads the block output over streams
    comb = Sinkhorn(softmax_rows(scale2 * m_comb + base_comb) + eps)   mixes the streams
    X'_k = post_k * y + sum_j comb[j, k] * X_j
comb is applied TRANSPOSED (sum over its first index); the opposite orientation is the
known train/rollout mismatch of Megatron-LM issue 4957. Sinkhorn: sinkhorn.py.
The projection m = fn @ rms_norm(x) is one Triton kernel on CUDA without gradients
(hc_projection_triton.py; `_mixes`); with gradients, eager, an autograd.Function that keeps no
fp32 copy of the streams (`ScaledProjection` for bf16 streams, else `NormedProjection`). The
collapse sum_i pre_i X_i and the mix comb^T X are Triton kernels in the eager CUDA bf16 forward
(stream_mix_triton.py; the collapse only with a gradient wanted, the trainer's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import hc_pre_triton, hc_projection_triton, scaled_projection_triton, stream_mix_triton
from .kernel_switch import Switched, forward_kernel_allowed, grad_wanted
from .bf16x3 import mm_bf16_fp32, mm_fp32_bf16
from .norm import inverse_rms, inverse_rms_one_pass, rms_norm
from .sinkhorn import sinkhorn
from .whole_rows import in_whole_rows, sigmoid_any_size, softmax_in_order, sum_in_order


def _triton_mixes(streams: torch.Tensor, fn: torch.Tensor, enabled: bool) -> bool:
    """Whether `_mixes` takes the Triton kernel for streams [N, S, n, D]: `enabled` (the
    triton_hc switch, kernel_switch.py), a decode step (S = 1:
    at prefill sizes cuBLAS is faster, 207 vs 300 us at 4,096 tokens on an H200; and S = 1 is
    already a compiled graph's specialisation, so the choice adds no compile guard), on CUDA,
    no gradient wanted (it is forward-only), and the kernel available for the shapes."""
    return (forward_kernel_allowed(enabled, streams, fn) and streams.dim() == 4
            and streams.shape[1] == 1 and hc_projection_triton.available(streams.flatten(-2), fn))


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float, triton: bool) -> torch.Tensor:
    """m = fn @ rms_norm(X.flatten()) in fp32: streams [..., n, D], fn [J, n * D] -> [..., J].
    On the Triton path, one kernel (products and sums of squares, split over K) plus a few
    element-wise ops that a compiled caller fuses; equal up to fp32 rounding."""
    x = streams.flatten(-2)
    # whole rows (whole_rows.py): the same kernel, its splits of K added in a fixed order
    in_order = in_whole_rows() and hc_projection_triton.available(x, fn)
    if in_order or _triton_mixes(streams, fn, triton):
        mixes = hc_projection_triton.hc_mixes(x.reshape(-1, x.shape[-1]), fn, eps, in_order=in_order)
        return mixes.view(*x.shape[:-1], fn.shape[0])
    if grad_wanted(x, fn) and not torch.compiler.is_compiling():
        if x.dtype == torch.bfloat16:
            return ScaledProjection.apply(x, fn, eps)
        return NormedProjection.apply(x, fn, eps)
    return _normed_projection(x, fn, eps)


def _normed_projection(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    return F.linear(rms_norm(x.float(), eps), fn.float())


class NormedProjection(torch.autograd.Function):
    """fn @ rms_norm(x) in fp32 (rms_norm's own ops, so the same bits), keeping for the
    backward only x (the bf16 streams, which the block keeps anyway) and the per-token 1/rms: the
    autograd of those ops kept x cast up to fp32 and the normalised fp32 copy, 2 x n*D*4 bytes per
    token and sub-block (8.6 GB of activations on the 1b config at 8 x 2048 tokens). The backward
    rebuilds the normalised x from them:
        xn = x * r,  d fn = g^T xn,  d xn = g fn,  d x = r (d xn - xn mean(d xn * xn)).
    Only where autograd would run (eager, gradient wanted); a compiled caller chooses its own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        r = inverse_rms(xf, eps)
        ctx.save_for_backward(x, fn, r)
        return F.linear(xf * r, fn.float())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, fn, r = ctx.saved_tensors
        g = g.float()  # bf16 where the forward ran under autocast (its GEMM in bf16); the backward's sums in fp32
        xn = x.float() * r
        grad_fn = None
        if ctx.needs_input_grad[1]:
            grad_fn = (g.reshape(-1, g.shape[-1]).t() @ xn.reshape(-1, xn.shape[-1])).to(fn.dtype)
        dxn = g @ fn.float()
        grad_x = (r * (dxn - xn * (dxn * xn).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_fn, None


class ScaledProjection(torch.autograd.Function):
    """fn @ rms_norm(x) for bf16 streams x (a bf16 trainer's eager forward with gradients; fn is
    kept in fp32, precision.py), with the norm's per-token scale r = 1/rms applied after the GEMM
    rather than before it:
        m = r * (x @ fn^T),  x never normalised.
    Its gradient, from g = dL/dm (D = n * H):
        d fn = (g r)^T x,    d x = (g r) @ fn - r^2 (g . m) / D * x
    The two GEMMs that read x take their fp32 operand (fn, g r) as three bf16 parts (bf16x3.py):
    fp32-accurate, on tensor cores, x read as it is. NormedProjection's ops read or wrote a
    [tokens, n*H] tensor ~25 times between them (the cast, the square, the normalised copy; in
    the backward the rebuilt copy and each term of d x), these ~7 (the forward's norm and GEMM
    read x; the backward's d fn GEMM reads it, d x's GEMM writes fp32, and one fused multiply-add
    reads both and writes d x in bf16): by that count ~5% of a 1b train step's device time (16
    calls on [16,384, 4,096]; an estimate, not yet measured). The same value up to fp32
    rounding, not the eager ops' bits.
    Saves x (kept by the block anyway), r and m (the output, which the coefficients keep too).
    With hand_through, x is also its second output (HyperConnection.pre): the gradient of that
    output is added to d x in the same kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: torch.Tensor, eps: float, hand_through: bool = False):
        flat = x.reshape(-1, x.shape[-1])
        r = inverse_rms_one_pass(flat, eps)
        m = mm_bf16_fp32(flat, fn.t()) * r
        ctx.save_for_backward(x, fn, r, m)
        ctx.set_materialize_grads(False)
        m = m.view(*x.shape[:-1], fn.shape[0])
        # hand_through: x handed on as a second output (`threads_streams`), its gradient added in here
        return (m, x) if hand_through else m

    @staticmethod
    def backward(ctx, g: torch.Tensor | None, grad_x_through: torch.Tensor | None = None):
        x, fn, r, m = ctx.saved_tensors
        if g is None:
            return grad_x_through, None, None, None
        flat = x.reshape(-1, x.shape[-1])
        g = g.reshape(-1, fn.shape[0]).float()
        gr = g * r
        grad_fn = mm_fp32_bf16(gr.t(), flat).to(fn.dtype) if ctx.needs_input_grad[1] else None
        s = r * r * (g * m).sum(-1, keepdim=True) / flat.shape[-1]
        # d x = (g r) @ fn - s x (+ the handed-through x's gradient), the sums in fp32 and the result
        # written once, in bf16: one kernel on a GPU (scaled_projection_triton.py), the fp32 GEMM then a
        # fused multiply-add elsewhere
        if scaled_projection_triton.applies(flat, fn):
            grad_x = scaled_projection_triton.streams_grad(gr, fn, s, flat, grad_x_through)
        else:
            grad_x = torch.addcmul(gr @ fn.float(), s, flat, value=-1)
            if grad_x_through is not None:
                grad_x += grad_x_through.reshape(flat.shape).float()
            grad_x = grad_x.to(flat.dtype)
        return grad_x.view(x.shape), grad_fn, None, None


class HyperConnection(Switched, nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        n = hc_mult
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def pre(self, streams: torch.Tensor, norm=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (the streams to combine this block's output into, then forward's three). Where
        `threads_streams` (the trainer's eager forward on a GPU) the streams are handed through the
        projection and the collapse (ScaledProjection, stream_mix_triton.Collapse) to the combine: the
        combine's gradient of them flows back through the collapse's and the projection's backward, each
        adding its own term in its kernel. Otherwise three consumers read the streams and autograd adds
        their gradients in two passes of its own over [tokens, n, D] (an add and an add_ per block, ~4.3 ms
        of a 1b train step on an H100, 2026-12-05). By count, 11 reads and writes of [tokens, n, D] a
        block's streams gradient took become 7 (~2.9 ms of that step at its copy bandwidth; not timed)."""
        triton = self.kernels.on("triton_hc")
        # a decode step on CUDA: two kernels; over whole rows the splits are added in order instead
        if self._takes_pre_step(streams, triton):
            fused = _norm_in_kernel(streams, norm)
            collapsed, post, comb = pre_step(streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.hc_eps,
                                             self.norm_eps, norm if fused else None)
            if fused:
                return streams, collapsed, post, comb
        else:
            through = threads_streams(streams, self.fn)
            if through:
                mixes, flat = ScaledProjection.apply(streams.flatten(-2), self.fn, self.norm_eps, True)
                streams = flat.view(streams.shape)
            else:
                mixes = _mixes(streams, self.fn, self.norm_eps, triton)
            pre, post, comb = hc_coefficients(mixes, self.base, self.scale, self.hc_mult, self.sinkhorn_iters,
                                              self.hc_eps, compiled=self.kernels.on("compile_hc"))
            collapsed, streams = _kernel_collapse(pre, streams) if through else (_collapse(pre, streams), streams)
        return streams, (collapsed if norm is None else norm(collapsed)), post, comb

    def forward(self, streams: torch.Tensor, norm=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [..., n, D] -> (collapsed [..., D], post [..., n] fp32, comb [..., n, n] fp32);
        norm (the block's RMSNorm): collapsed after it."""
        return self.pre(streams, norm)[1:]

    def _takes_pre_step(self, streams: torch.Tensor, triton: bool) -> bool:
        """A decode step on CUDA (or the interpreter's tests): `pre_step`'s two kernels."""
        return _triton_mixes(streams, self.fn, triton) and hc_pre_triton.available(streams) and not in_whole_rows()

    def after(self, streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              norm=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The previous block's combine, hc_combine(streams, block_out, post, comb), then this
        connection's forward of its result -> (the combined streams, this forward's three). At a
        decode step with bf16 streams the combine runs inside the projection's kernel
        (hc_projection_triton.hc_combine_partials): inductor's combine kernel goes."""
        n, D = streams.shape[-2:]
        if (self._takes_pre_step(streams, self.kernels.on("triton_hc")) and _norm_in_kernel(streams, norm)
                and block_out.dtype == torch.bfloat16 and hc_projection_triton.combines(n, D, self.fn)):
            return pre_step(streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.hc_eps, self.norm_eps,
                            norm, after=(block_out, post, comb))
        return self.pre(hc_combine(streams, block_out, post, comb), norm)


def threads_streams(streams: torch.Tensor, fn: torch.Tensor) -> bool:
    """Whether HyperConnection.pre hands the streams through the projection and the collapse: the
    trainer's eager forward (a gradient wanted, not compiled, not over whole rows) with bf16 streams on
    CUDA, where ScaledProjection and Collapse run their kernels."""
    return (streams.is_cuda and streams.dtype == torch.bfloat16 and stream_mix_triton.triton is not None
            and grad_wanted(streams, fn) and not torch.compiler.is_compiling() and not in_whole_rows())


def _norm_in_kernel(streams: torch.Tensor, norm) -> bool:
    """pre_step applies the block's norm in its second kernel (a kernel less a block): bf16 streams."""
    return norm is not None and streams.dtype == torch.bfloat16


def pre_step(streams, fn, base, scale, iters: int, hc_eps: float, norm_eps: float, norm=None, after=None):
    """HyperConnection's forward as two kernels: the projection's split-K partials
    (hc_projection_triton.py), then the mixes, coefficients, Sinkhorn and collapse in one
    (hc_pre_triton.py: 61 us less of a 1b decode step's device time than compiled torch ops), with
    the block's RMSNorm `norm` (bf16 streams) after the collapse. With `after` (the previous block's
    output, post, comb): its combine into the streams first, inside the partials' kernel, and the
    combined streams first in the result."""
    n, D = streams.shape[-2:]
    lead = streams.shape[:-2]
    flat = streams.reshape(-1, n, D)
    split = hc_projection_triton.default_split(n * D)
    if after is None:
        partials = hc_projection_triton.hc_mix_partials(flat.flatten(-2), fn, split)
    else:
        y, post, comb = after
        partials, flat = hc_projection_triton.hc_combine_partials(flat, y.reshape(-1, D), post.reshape(-1, n),
                                                                 comb.reshape(-1, n, n), fn, split)
    normed = {} if norm is None else dict(norm_weight=norm.weight, block_eps=norm.eps)
    x_in, post, comb = hc_pre_triton.hc_pre_step(partials, flat, base, scale, iters, hc_eps, norm_eps, **normed)
    out = x_in.view(*lead, D), post.view(*lead, n), comb.view(*lead, n, n)
    return out if after is None else (flat.view(streams.shape), *out)


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_i pre_i X_i in fp32, rounded once: pre [..., n] fp32, streams [..., n, D] -> [..., D]."""
    if _collapse_kernels(pre, streams):  # the trainer's eager forward on a GPU
        return _kernel_collapse(pre, streams)[0]
    weighted = pre.unsqueeze(-1) * streams
    summed = sum_in_order(weighted, -2) if in_whole_rows() else weighted.sum(dim=-2)
    return summed.to(streams.dtype)


def _kernel_collapse(pre: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_collapse by stream_mix_triton.Collapse -> (the collapse [..., D], the streams handed through)."""
    n, D = streams.shape[-2:]
    flat, handed = stream_mix_triton.Collapse.apply(pre.reshape(-1, n), streams.reshape(-1, n, D))
    return flat.view(pre.shape[:-1] + (D,)), handed.view(streams.shape)


def _collapse_kernels(pre: torch.Tensor, streams: torch.Tensor) -> bool:
    """Whether `_collapse` takes the Triton kernels with their backward (stream_mix_triton.Collapse):
    eager on CUDA in bf16 with a gradient wanted, i.e. the trainer's forward. Without one (the
    engine's eager prefill) the ops below keep their bits; compiled, the caller's compilation fuses them."""
    return (streams.is_cuda and streams.dtype == torch.bfloat16 and stream_mix_triton.triton is not None
            and grad_wanted(pre, streams) and not torch.compiler.is_compiling() and not in_whole_rows())


def _coefficients(mixes, base, scale, n: int, iters: int, eps: float):
    """pre [..., n], post [..., n], comb [..., n, n] from the projected mixes, all fp32."""
    m_pre, m_post, m_comb = mixes.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    sigmoid, softmax = (sigmoid_any_size, softmax_in_order) if in_whole_rows() else (torch.sigmoid, torch.softmax)
    pre = sigmoid(m_pre * s_pre + b_pre) + eps
    post = 2 * sigmoid(m_post * s_post + b_post)
    comb = softmax(m_comb.unflatten(-1, (n, n)) * s_comb + b_comb.view(n, n), dim=-1) + eps
    return pre, post, sinkhorn(comb, iters, eps)


# On GPUs, outside a compiled region (the trainer's eager forward, the engine's prefill), the
# coefficients' element-wise ops are compiled once (dynamic shapes) so that they fuse; the Sinkhorn
# in them is one Triton kernel either way (sinkhorn_triton.py). Trainer and engine call the same
# function, so both sides run the same kernels; their `compile_hc` switch (kernel_switch.py) off
# keeps it eager.
_compiled_coefficients = None


def hc_coefficients(mixes, base, scale, n: int, iters: int, eps: float, compiled: bool = True):
    global _compiled_coefficients
    # inside a compiled region (the engine's decode step) the caller's compilation fuses it
    if not compiled or not mixes.is_cuda or torch.compiler.is_compiling():
        return _coefficients(mixes, base, scale, n, iters, eps)
    if _compiled_coefficients is None:
        _compiled_coefficients = torch.compile(_coefficients, dynamic=True, fullgraph=True)
    return _compiled_coefficients(mixes, base, scale, n, iters, eps)


def hc_combine(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * y + sum_j comb[j, k] X_j   (streams [..., n, D], block_out [..., D])."""
    dtype = streams.dtype
    comb = comb.to(dtype)
    if torch.compiler.is_compiling() or in_whole_rows():
        # the same sums written element-wise (bf16 values, fp32 sums, one rounding: what the bf16
        # GEMM computes), so inductor fuses them with the rest; as a GEMM it was a cuBLAS batched
        # call of 4 x 4 x D products per token, ~9 us twice per layer in a decode step. Eager does
        # not take it: this form's [..., n, n, D] fp32 product would be materialised. Over whole rows
        # (whole_rows.py) the sum over j is added left to right, whatever the row count.
        prods = comb.float().unsqueeze(-1) * streams.float().unsqueeze(-2)  # [..., j, k, D]
        mixed = (sum_in_order(prods, -3) if in_whole_rows() else prods.sum(dim=-3)).to(dtype)
    elif streams.is_cuda and dtype == torch.bfloat16 and stream_mix_triton.combine_kernels_take(streams):
        # the same sums (bf16 products, fp32, one rounding) in one pass over the streams, where
        # cuBLAS's batch of per-token 4 x 4 GEMMs was ~9% of a train step, with post_k y added in
        # the same pass and the eager ops' roundings (stream_mix_triton.py: StreamCombine)
        n, D = streams.shape[-2:]
        out = stream_mix_triton.StreamCombine.apply(streams.reshape(-1, n, D), block_out.reshape(-1, D),
                                                    post.to(dtype).reshape(-1, n), comb.reshape(-1, n, n))
        return out.view(streams.shape)
    else:
        mixed = torch.matmul(comb.transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


class HyperHead(Switched, nn.Module):
    """Final collapse of the streams before the output norm: u = sum_i pre_i X_i."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = _mixes(streams, self.hc_fn, self.norm_eps, self.kernels.on("triton_hc"))
        sigmoid = sigmoid_any_size if in_whole_rows() else torch.sigmoid
        pre = sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return _collapse(pre, streams)
