"""mHC's Sinkhorn as one Triton kernel, registered as the custom op `lockstep::sinkhorn`.

Each program normalises BLOCK_T tokens' n x n matrices in registers: the whole loop
(1 + 2 * (iters - 1) normalisations) is one launch instead of ~40 reductions plus divisions.
As a `torch.library.triton_op`, torch.compile keeps it as one opaque kernel: written out
element by element instead, the loop became thousands of graph nodes per mHC call and
inductor took minutes per decoder layer to compile them.

Numerics: each step is x / (sum + eps) with IEEE division (`div_rn`; Triton's `/` is an
approximate reciprocal on GPUs); the sums over 4 entries are a reduction tree where the plain
loop (`sinkhorn_reference`) adds in its own order, so results agree to float32 rounding
(tests/models/test_sinkhorn.py). Trainer and engine both call this op on CUDA, so they
compute the same coefficients.

Backward (the trainer): recompute the forward's steps with torch ops and apply the
written-out gradient of sinkhorn.py; the matrices are 4 x 4 per token, so this costs little
next to the layer around it. Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the plain loop in sinkhorn.py is always there
    triton = None

BLOCK_T = 32  # tokens per program: 32 x 16 fp32 values fit a warp's registers several times over


def available(comb: torch.Tensor) -> bool:
    """The fused kernel can run on comb: Triton present, power-of-two n (tl.arange's rule), fp32
    (`div_rn` is float32's; mHC computes its coefficients in fp32)."""
    n = comb.shape[-1]
    return triton is not None and n & (n - 1) == 0 and comb.dtype == torch.float32


if triton is not None:

    @triton.jit
    def _normalise(x, axis: tl.constexpr, eps):
        # inductor passes Python floats as fp64 scalars; div_rn is fp32-only
        return tl.math.div_rn(x, (tl.sum(x, axis=axis, keep_dims=True) + eps).to(tl.float32))

    @triton.jit
    def _sinkhorn_kernel(x_ptr, y_ptr, num_tokens, iters, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        i = tl.arange(0, N)
        offs = t[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
        mask = (t < num_tokens)[:, None, None]
        x = tl.load(x_ptr + offs, mask=mask, other=1.0)
        # columns first (sum over rows, dim -2), then (rows, columns) iters - 1 times
        x = _normalise(x, 1, eps)
        for _ in range(iters - 1):
            x = _normalise(x, 2, eps)
            x = _normalise(x, 1, eps)
        tl.store(y_ptr + offs, x, mask=mask)

    @torch.library.triton_op("lockstep::sinkhorn", mutates_args=())
    def sinkhorn_fused(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """comb [..., n, n] (contiguous or not) -> doubly stochastic, one kernel."""
        x = comb.contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        num_tokens = x.numel() // (n * n)
        grid = (triton.cdiv(num_tokens, BLOCK_T),)
        torch.library.wrap_triton(_sinkhorn_kernel)[grid](x, out, num_tokens, iters, eps, N=n, BLOCK=BLOCK_T)
        return out

    def _setup_context(ctx, inputs, output):
        comb, iters, eps = inputs
        ctx.save_for_backward(comb)
        ctx.iters, ctx.eps = iters, eps

    def _backward(ctx, grad):
        from lockstep.models.layers.sinkhorn import sinkhorn_backward

        (comb,) = ctx.saved_tensors
        return sinkhorn_backward(comb, grad, ctx.iters, ctx.eps), None, None

    sinkhorn_fused.register_autograd(_backward, setup_context=_setup_context)
