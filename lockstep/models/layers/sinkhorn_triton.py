"""mHC's Sinkhorn as one Triton kernel, registered as the custom op `lockstep::sinkhorn`.

The whole loop (1 + 2 * (iters - 1) normalisations) is one launch instead of ~40 reductions
plus divisions. As a `torch.library.triton_op`, torch.compile keeps it as one opaque kernel:
written out element by element instead, the loop became thousands of graph nodes per mHC call
and inductor took minutes per decoder layer to compile them.

Layout: one token per thread. The kernel is pure latency (in the decode step: 64 tokens, 16
calls per step, 39 dependent normalisations of 4 x 4 matrices), so what counts is the length
of one thread's instruction chain. Each token's n x n entries are held as n * n separate 1-D
[BLOCK] vectors over tokens (a tuple, unrolled with tl.static_range over the constexpr n), so a
thread holds its whole matrix in registers and row and column sums are plain adds. As one
[BLOCK, n, n] tensor (the previous kernel), the compiler spread each matrix over threads and
every sum took two rounds of warp shuffles. A program is one warp of BLOCK = 32 tokens: more
tokens per program would not shorten the chain, and 64 tokens make 2 programs on 2 SMs.
Unrolled per entry, n is capped at MAX_N (n = 8: 64 values per thread, no spills); mHC's n is
hc_mult, 4 in DeepSeek-V4. Larger n (or other dtypes) take the plain loop in sinkhorn.py.

Division: per line (row or column) one reciprocal of its sum s, then per entry the correctly
rounded quotient from it (Markstein's correction):
    y = 1 / s refined by one Newton step,  q = x * y,  r = fma(-q, s, x),  x / s = fma(r, y, q)
These are the instructions of the fast path of CUDA's IEEE division (`div.rn.f32` compiles to
MUFU.RCP and these FFMAs), which is correctly rounded whenever x, s and x / s are normal
floats (mHC's entries are softmax + eps, nowhere near 2^-126); left out are its range check
(FCHK) and the branch to the slow path. Per entry `tl.math.div_rn`, as before, paid a MUFU and
five FFMAs per entry, and ptxas serialises the divisions around their slow-path branches.
Here a normalisation of a 4 x 4 matrix is ~110 SASS instructions (sm_90) without a branch, and
the four lines' chains interleave. x * (1 / s) alone would be cheaper still but rounds
differently (up to 6.6e-7 from the loop, measured; too close to the 1e-6 the tests allow).
Sums add in the plain loop's order (x_0 + x_1 + ... along the line, as torch's CPU sum does),
so on the CPU the kernel (Triton's interpreter) equals `sinkhorn_reference` bit for bit; on a
GPU it equals the same loop with the sums written out in that order (test_sinkhorn.py). Trainer
and engine both call this op on CUDA, so they compute the same coefficients.

Backward (the trainer): one more kernel, `lockstep::sinkhorn_backward`. It recomputes the
forward's steps (they are not kept: 39 x 16 floats a token), writing each step's output to a
scratch buffer, then walks the steps back applying sinkhorn.py's written-out gradient,
dx = (g - sum_line(g * y)) / s, with each line's s recomputed from the step's input in the
forward's order. Done with torch ops, that backward was 273 launches of a few-byte kernel per
mHC call (~4,400 of a 1b train step's), each paying the host's launch cost (one H200:
grpo_step.py --config gpu-848m's train part went 0.293 -> 0.192 s with the kernel). Its gradient agrees
with the torch one to fp32 rounding (sums of g * y may add in another order), not bitwise.
Testable on CPU with TRITON_INTERPRET=1.
Benchmark: benchmarks/sinkhorn_kernel.py.
"""

from __future__ import annotations

import torch

from lockstep.triton_support import load_triton

triton = load_triton()  # None: the plain loop in sinkhorn.py is always there
if triton is not None:
    import triton.language as tl

BLOCK_T = 32  # tokens per program: one per lane of the program's single warp
MAX_N = 8  # n * n values per thread, unrolled: n = 8 is 64 registers' worth


def available(comb: torch.Tensor) -> bool:
    """The fused kernel can run on comb: Triton present, n <= MAX_N (unrolled per entry), fp32
    (the division trick is float32's; mHC computes its coefficients in fp32)."""
    return triton is not None and 1 <= comb.shape[-1] <= MAX_N and comb.dtype == torch.float32


if triton is not None:

    @triton.jit
    def _reciprocal(s):
        """~1 / s to within an ulp: Triton's `/` is an approximate reciprocal on GPUs (MUFU.RCP;
        exact in the interpreter), refined by one Newton step, as CUDA's div.rn does."""
        y = 1.0 / s
        return tl.fma(y, tl.fma(-s, y, 1.0), y)

    @triton.jit
    def _divide(x, s, y):
        """x / s correctly rounded, from y = _reciprocal(s): the remainder x - q * s is exact in an fma."""
        q = x * y
        return tl.fma(tl.fma(-q, s, x), y, q)

    @triton.jit
    def _normalise(x, N: tl.constexpr, LINE: tl.constexpr, STEP: tl.constexpr, eps):
        """x: tuple of the N * N entries (row-major), each a [BLOCK] vector over tokens. Divide
        each by the sum of its line (+ eps): line a holds entries a * LINE + b * STEP, b < N;
        rows: LINE = N, STEP = 1; columns: LINE = 1, STEP = N. Entry k is in line (k // LINE) % N."""
        s = ()
        y = ()
        for a in tl.static_range(N):
            acc = x[a * LINE]
            for b in tl.static_range(1, N):
                acc = acc + x[a * LINE + b * STEP]  # left to right, as the plain loop adds
            s = s + (acc + eps,)
            y = y + (_reciprocal(acc + eps),)
        out = ()
        for k in tl.static_range(N * N):
            out = out + (_divide(x[k], s[(k // LINE) % N], y[(k // LINE) % N]),)
        return out

    @triton.jit
    def _sinkhorn_kernel(x_ptr, y_ptr, num_tokens, iters, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = t < num_tokens
        # inductor passes Python floats as fp64 scalars; the loop adds eps rounded to fp32
        eps = tl.cast(eps, tl.float32)
        x = ()
        for k in tl.static_range(N * N):
            x = x + (tl.load(x_ptr + t * (N * N) + k, mask=mask, other=1.0),)
        # columns first (sum over rows, dim -2), then (rows, columns) iters - 1 times
        x = _normalise(x, N, 1, N, eps)
        for _ in range(iters - 1):
            x = _normalise(x, N, N, 1, eps)
            x = _normalise(x, N, 1, N, eps)
        for k in tl.static_range(N * N):
            tl.store(y_ptr + t * (N * N) + k, x[k], mask=mask)

    @triton.jit
    def _normalise_backward(g, y, x, N: tl.constexpr, LINE: tl.constexpr, STEP: tl.constexpr, eps):
        """dL/dx of one step y = _normalise(x, N, LINE, STEP, eps), from g = dL/dy:
        (g - sum_line(g * y)) / s with s = sum_line(x) + eps, the step's own denominator."""
        s = ()
        y_s = ()
        r = ()
        for a in tl.static_range(N):
            acc = x[a * LINE]
            dot = g[a * LINE] * y[a * LINE]
            for b in tl.static_range(1, N):
                acc = acc + x[a * LINE + b * STEP]
                dot = dot + g[a * LINE + b * STEP] * y[a * LINE + b * STEP]
            s = s + (acc + eps,)
            y_s = y_s + (_reciprocal(acc + eps),)
            r = r + (dot,)
        out = ()
        for k in tl.static_range(N * N):  # the line's index inline: a tuple takes constexpr indices only
            out = out + (_divide(g[k] - r[(k // LINE) % N], s[(k // LINE) % N], y_s[(k // LINE) % N]),)
        return out

    @triton.jit
    def _store_step(scratch_ptr, step, x, t, mask, num_tokens, N: tl.constexpr):
        for k in tl.static_range(N * N):
            tl.store(scratch_ptr + (step * (N * N) + k) * num_tokens + t, x[k], mask=mask)

    @triton.jit
    def _load_step(scratch_ptr, step, t, mask, num_tokens, N: tl.constexpr):
        x = ()
        for k in tl.static_range(N * N):
            x = x + (tl.load(scratch_ptr + (step * (N * N) + k) * num_tokens + t, mask=mask, other=1.0),)
        return x

    @triton.jit
    def _sinkhorn_backward_kernel(x_ptr, g_ptr, dx_ptr, scratch_ptr, num_tokens, iters, eps,
                                  N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = t < num_tokens
        eps = tl.cast(eps, tl.float32)
        x = ()
        g = ()
        for k in tl.static_range(N * N):
            x = x + (tl.load(x_ptr + t * (N * N) + k, mask=mask, other=1.0),)
            g = g + (tl.load(g_ptr + t * (N * N) + k, mask=mask, other=0.0),)
        # the forward again, step s's output kept as scratch[s]: the column step is step 0, then
        # (rows, columns) are steps (2i + 1, 2i + 2)
        y = _normalise(x, N, 1, N, eps)
        _store_step(scratch_ptr, 0, y, t, mask, num_tokens, N)
        for i in range(iters - 1):
            y = _normalise(y, N, N, 1, eps)
            _store_step(scratch_ptr, 2 * i + 1, y, t, mask, num_tokens, N)
            y = _normalise(y, N, 1, N, eps)
            _store_step(scratch_ptr, 2 * i + 2, y, t, mask, num_tokens, N)
        # back through the steps: step s's input is scratch[s - 1] (step 0's is x)
        for j in range(iters - 1):
            i = iters - 2 - j
            cols_in = _load_step(scratch_ptr, 2 * i + 1, t, mask, num_tokens, N)
            g = _normalise_backward(g, _load_step(scratch_ptr, 2 * i + 2, t, mask, num_tokens, N), cols_in,
                                    N, 1, N, eps)
            g = _normalise_backward(g, cols_in, _load_step(scratch_ptr, 2 * i, t, mask, num_tokens, N),
                                    N, N, 1, eps)
        g = _normalise_backward(g, _load_step(scratch_ptr, 0, t, mask, num_tokens, N), x, N, 1, N, eps)
        for k in tl.static_range(N * N):
            tl.store(dx_ptr + t * (N * N) + k, g[k], mask=mask)

    @torch.library.triton_op("lockstep::sinkhorn_backward", mutates_args=())
    def sinkhorn_backward_fused(comb: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """dL/dcomb from dL/dout (both [..., n, n]), one kernel."""
        x, g = comb.contiguous(), grad.contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        num_tokens = x.numel() // (n * n)
        # token-minor so that a warp's loads and stores of one entry are one coalesced line
        scratch = torch.empty((2 * iters - 1, n * n, num_tokens), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(num_tokens, BLOCK_T),)
        torch.library.wrap_triton(_sinkhorn_backward_kernel)[grid](
            x, g, out, scratch, num_tokens, iters, eps, N=n, BLOCK=BLOCK_T, num_warps=BLOCK_T // 32)
        return out

    @torch.library.triton_op("lockstep::sinkhorn", mutates_args=())
    def sinkhorn_fused(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """comb [..., n, n] (contiguous or not) -> doubly stochastic, one kernel."""
        x = comb.contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        num_tokens = x.numel() // (n * n)
        grid = (triton.cdiv(num_tokens, BLOCK_T),)
        torch.library.wrap_triton(_sinkhorn_kernel)[grid](x, out, num_tokens, iters, eps, N=n, BLOCK=BLOCK_T,
                                                          num_warps=BLOCK_T // 32)
        return out

    def _setup_context(ctx, inputs, output):
        comb, iters, eps = inputs
        ctx.save_for_backward(comb)
        ctx.iters, ctx.eps = iters, eps

    def _backward(ctx, grad):
        (comb,) = ctx.saved_tensors
        return sinkhorn_backward_fused(comb, grad.float(), ctx.iters, ctx.eps), None, None

    sinkhorn_fused.register_autograd(_backward, setup_context=_setup_context)
