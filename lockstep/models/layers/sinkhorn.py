"""Sinkhorn normalisation of mHC's stream-mixing matrices (DSV4_SPEC: `comb` is made doubly
stochastic): one column normalisation, then (iters - 1) x (rows, columns), each
x <- x / (x.sum(dim) + eps).

The matrices are hc_mult x hc_mult (4 x 4) per token, so every step of the plain loop is a
kernel launch over a few bytes: cost is per op, not per element. On CUDA the whole loop is one
Triton kernel (sinkhorn_triton.py), for the engine and the trainer alike. Elsewhere (CPU) the
plain loop runs; with gradients, through an autograd.Function whose backward is written out,
one line per step instead of ~8 recorded autograd nodes. For y = x / S, S = sum_d x + eps:

    dL/dx = (g - sum_d(g * y)) / S           (g = dL/dy, sum_d keeps the normalised dim)

Forward values of the plain loop and of the autograd.Function are the same ops in the same order.
"""

from __future__ import annotations

import torch

from . import sinkhorn_triton
from .whole_rows import in_whole_rows


def _dims(iters: int) -> list[int]:
    return [-2] + [-1, -2] * (iters - 1)


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    for dim in _dims(iters):
        comb = comb / (comb.sum(dim=dim, keepdim=True) + eps)
    return comb


def sinkhorn_in_kernel_order(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The plain loop with each line's sum written out left to right, the order in which the fused
    kernel (sinkhorn_triton.py) adds; with IEEE division, on any device (torch's own sum may add
    in another order on a GPU). The kernel equals it bit for bit."""
    for dim in _dims(iters):
        lines = comb.unbind(dim)
        total = lines[0]
        for line in lines[1:]:
            total = total + line
        comb = comb / (total.unsqueeze(dim) + eps)
    return comb


def _forward_saving(comb: torch.Tensor, iters: int, eps: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The plain loop, keeping each step's (output, denominator) for the backward."""
    saved = []
    for dim in _dims(iters):
        denom = comb.sum(dim=dim, keepdim=True).add_(eps)
        comb = comb / denom
        saved += [comb, denom]
    return comb, saved


def _backward_from(saved: list[torch.Tensor], grad: torch.Tensor, iters: int) -> torch.Tensor:
    dims = _dims(iters)
    for i in reversed(range(len(dims))):
        out, denom = saved[2 * i], saved[2 * i + 1]
        grad = (grad - (grad * out).sum(dim=dims[i], keepdim=True)) / denom
    return grad


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comb, iters: int, eps: float):
        out, saved = _forward_saving(comb, iters, eps)
        ctx.iters = iters
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _backward_from(list(ctx.saved_tensors), grad, ctx.iters), None, None


def sinkhorn_backward(comb: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """dL/dcomb from dL/dout, recomputing the forward's steps (the fused forward keeps none): the
    reference the fused backward kernel (sinkhorn_triton.sinkhorn_backward_fused, which CUDA runs)
    is held to in the tests."""
    _, saved = _forward_saving(comb, iters, eps)
    return _backward_from(saved, grad, iters)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., n, n] -> doubly-stochastic (up to eps) [..., n, n]."""
    if comb.is_cuda and sinkhorn_triton.available(comb):
        return sinkhorn_triton.sinkhorn_fused(comb, iters, eps)
    if in_whole_rows():  # the kernel's order, whatever the row count (whole_rows.py)
        return sinkhorn_in_kernel_order(comb, iters, eps)
    if comb.requires_grad and torch.is_grad_enabled():
        return _Sinkhorn.apply(comb, iters, eps)
    return sinkhorn_reference(comb, iters, eps)
