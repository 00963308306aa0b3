"""Sinkhorn normalisation of mHC's stream-mixing matrices (DSV4_SPEC: `comb` is made doubly
stochastic): one column normalisation, then (iters - 1) x (rows, columns), each
x <- x / (x.sum(dim) + eps).

The matrices are hc_mult x hc_mult (4 x 4) per token, so every step is a kernel launch over a
few bytes: cost is per op, not per element. Eager autograd records ~8 nodes per step; the
backward here is written out instead, one line per step. For y = x / S, S = sum_d x + eps:

    dL/dx = (g - sum_d(g * y)) / S           (g = dL/dy, sum_d keeps the normalised dim)

Forward values are the same ops in the same order as the plain loop (`sinkhorn_reference`),
so the engine (no grad) and the trainer (grad) compute identical coefficients.

Under torch.compile (the engine's decode step and the trainer's mHC on GPUs) the loop is written
element by element instead (`sinkhorn_unrolled`): n*n tensors of the token shape, sums as
explicit additions. Every op is then point-wise over the same index space and inductor fuses the
whole normalisation, forward and backward, into a kernel or two; with `sum(dim)` it emitted one
reduction kernel per step (~40 per mHC call, a third of a decode step's kernels on a 1B config).
"""

from __future__ import annotations

import torch


def _dims(iters: int) -> list[int]:
    return [-2] + [-1, -2] * (iters - 1)


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    for dim in _dims(iters):
        comb = comb / (comb.sum(dim=dim, keepdim=True) + eps)
    return comb


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comb, iters: int, eps: float):
        dims, saved = _dims(iters), []
        for dim in dims:
            denom = comb.sum(dim=dim, keepdim=True).add_(eps)
            comb = comb / denom
            saved += [comb, denom]
        ctx.dims = dims
        ctx.save_for_backward(*saved)
        return comb

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        for i in reversed(range(len(ctx.dims))):
            out, denom, dim = saved[2 * i], saved[2 * i + 1], ctx.dims[i]
            grad = (grad - (grad * out).sum(dim=dim, keepdim=True)) / denom
        return grad, None, None


def sinkhorn_unrolled(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    n = comb.shape[-1]
    c = [list(row.unbind(-1)) for row in comb.unbind(-2)]  # c[i][j]: [...] each
    for dim in _dims(iters):
        for k in range(n):
            if dim == -1:  # row k: sum over j of c[k][j]
                denom = _sum_in_order([c[k][j] for j in range(n)]) + eps
                c[k] = [c[k][j] / denom for j in range(n)]
            else:  # column k: sum over i of c[i][k]
                denom = _sum_in_order([c[i][k] for i in range(n)]) + eps
                for i in range(n):
                    c[i][k] = c[i][k] / denom
    return torch.stack([torch.stack(row, dim=-1) for row in c], dim=-2)


def _sum_in_order(xs: list[torch.Tensor]) -> torch.Tensor:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., n, n] -> doubly-stochastic (up to eps) [..., n, n]."""
    if torch.compiler.is_compiling():
        return sinkhorn_unrolled(comb, iters, eps)
    if comb.requires_grad and torch.is_grad_enabled():
        return _Sinkhorn.apply(comb, iters, eps)
    return sinkhorn_reference(comb, iters, eps)
