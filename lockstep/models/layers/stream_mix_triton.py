"""mHC's stream mix comb^T @ X per token, as the Triton custom op `lockstep::stream_mix`, and the
autograd of the combine around it (`StreamCombine`) for the eager CUDA forward (hyper_connection.hc_combine).

    out[t, k, :] = sum_j comb[t, j, k] * X[t, j, :]      (j = 0 .. n-1 in order, fp32, one rounding)

Why a kernel: as a GEMM this is a batched call of one n x n by n x D product per token, and cuBLAS
runs a batch of 16,384 of them (4 x 4 by 4 x 1024, the 1b config at 8 x 2048 tokens) with small
wmma tiles in 1.25 ms, at ~5% of the copy bandwidth its bytes need: 40 ms of a 440 ms train step on
an H200 (forward and the streams' gradient, twice per layer). The kernel reads the streams once
and writes the mix once. Numerics are the bf16 GEMM's: bf16 products are exact in fp32, summed in
fp32 and rounded once; here the sum runs j = 0 .. n-1, as `stream_mix_reference` (the CPU
reference, and the path wherever Triton cannot run) does, so the two give the same bits.

The same kernel mixes n streams into any number K of outputs (comb [T, n, K]): mHC's collapse of
the streams into the block input, sum_i pre_i X_i (K = 1, fp32 weights), is one, and `Collapse` is
its autograd for the trainer (hyper_connection._collapse): eager, the collapse and its gradient made
fp32 copies of the [T, n, D] streams (the weighted terms, the upcast gradient times pre, the
gradient times the streams for d pre), ~2.4 GB of traffic per call on the 1b config at 8 x 2048
tokens where the kernels move ~0.5 GB (an estimate from the tensor sizes, not yet measured). The
backward (`lockstep::collapse_backward`) writes d X = pre_i g rounded to X's dtype, as the eager
autograd did, and d pre_i = sum_d g X_i in fp32, per token in one program.

`StreamCombine` is the whole of mHC's combine after a sub-block, X'_k = post_k y + sum_j comb[j, k]
X_j (hyper_connection.hc_combine), for the trainer: the forward is the mix kernel with the block
output added in the eager ops' roundings (post_k y rounded, the mix rounded, their sum rounded: the
same bits), the backward one program per token reading g, X and y once, its sums as two small
tensor-core products per pass (d X, d y rounded to their dtype; d comb, d post in fp32). Eagerly
the product, the sum and their gradients (two broadcast products and two reductions) moved ~3x the
bytes (estimated from the tensor sizes: ~2.2 vs ~0.75 GB per call on the 1b config at 8 x 2048
tokens; in the train step measured on an H200 only together with this session's other changes:
README).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl


def stream_mix_reference(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """comb [T, n, K], streams [T, n, D] -> [T, K, D] in streams' dtype: sum_j comb[:, j, k] X_j."""
    terms = comb.float().unsqueeze(-1)  # [T, j, k, 1]
    x = streams.float()
    out = terms[:, 0] * x[:, 0:1]
    for j in range(1, streams.shape[1]):
        out = out + terms[:, j] * x[:, j:j + 1]
    return out.to(streams.dtype)


def _kernel_runs(streams: torch.Tensor) -> bool:
    """This file's kernels can take streams: Triton present, on CUDA (or the interpreter)."""
    return triton is not None and (streams.is_cuda or _gt.interpreted())


def stream_mix(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The kernel where it runs (CUDA, or the interpreter), the reference elsewhere."""
    if _kernel_runs(streams):
        return stream_mix_op(comb, streams)
    return stream_mix_reference(comb, streams)


class Collapse(torch.autograd.Function):
    """pre [T, n] (fp32), streams [T, n, D] -> (sum_i pre_i X_i [T, D] in streams' dtype, the streams
    themselves), the kernel forward (the mix into K = 1 output) and backward. Saves pre and the streams.
    The streams handed through: where the caller combines into them (hyper_connection.py threads the
    block's streams projection -> collapse -> combine), their gradient reaches this backward, which adds
    its own term to it in the same pass (`collapse_backward`'s addend), where autograd would add the
    consumers' gradients of the streams in passes of their own."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # a streams output nobody combined into: no gradient, not zeros
        ctx.save_for_backward(pre, streams)
        return stream_mix(pre.unsqueeze(-1), streams).squeeze(1), streams

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, grad_streams: torch.Tensor | None):
        pre, streams = ctx.saved_tensors
        if grad is None:
            return None, grad_streams
        d_pre, d_streams = collapse_backward(pre, streams, grad, grad_streams)
        return (d_pre if ctx.needs_input_grad[0] else None), (d_streams if ctx.needs_input_grad[1] else None)


class StreamCombine(torch.autograd.Function):
    """streams [T, n, D], block output y [T, D], post [T, K], comb [T, n, K] (post and comb in the
    streams' dtype, as hc_combine casts them) -> post_k y + sum_j comb[j, k] X_j [T, K, D]: the
    kernels forward and backward. Saves the four inputs (the streams and y are kept by the block anyway)."""

    @staticmethod
    def forward(ctx, streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(streams, y, post, comb)
        return stream_combine_op(comb, streams, post, y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        streams, y, post, comb = ctx.saved_tensors
        d_streams, d_y, d_post, d_comb = stream_combine_backward_op(comb, streams, post, y, grad)
        return d_streams, d_y, d_post.to(post.dtype), d_comb.to(comb.dtype)


def stream_combine_reference(comb: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                             y: torch.Tensor) -> torch.Tensor:
    """The eager ops of hc_combine (bf16 roundings included): post_k y + comb^T X."""
    return post.unsqueeze(-1) * y.unsqueeze(-2) + stream_mix_reference(comb, streams)


def combine_kernels_take(streams: torch.Tensor) -> bool:
    """StreamCombine's kernels can take these streams: this file's kernels run (any n: the backward
    pads its rows to its MMA tile)."""
    return _kernel_runs(streams)


def collapse_backward_reference(pre: torch.Tensor, streams: torch.Tensor, grad: torch.Tensor,
                                addend: torch.Tensor | None = None):
    """(d pre [T, n] fp32, d streams [T, n, D] in streams' dtype) of the collapse, from grad [T, D]:
    the eager autograd's values (d pre summed in its own order); with `addend` [T, n, D], d streams is
    addend + pre_i grad, summed in fp32 and rounded once."""
    g = grad.float().unsqueeze(1)
    d_streams = pre.float().unsqueeze(-1) * g
    if addend is not None:
        d_streams = addend.float() + d_streams
    return (g * streams.float()).sum(-1), d_streams.to(streams.dtype)


def collapse_backward(pre: torch.Tensor, streams: torch.Tensor, grad: torch.Tensor,
                      addend: torch.Tensor | None = None):
    """The kernel where it runs (CUDA, or the interpreter), the reference elsewhere."""
    if _kernel_runs(streams):
        return collapse_backward_op(pre, streams, grad, addend)
    return collapse_backward_reference(pre, streams, grad, addend)


MIX_BLOCK = 1024  # hidden elements per program


if triton is not None:
    _bf16 = _gt._bf16  # by name: torch.compile's compile worker cannot resolve a module alias
    _bf16_bits = _gt._bf16_bits

    @triton.jit
    def _combined(mixed, p, y, INTERPRETED: tl.constexpr):
        """One stream of hc_combine in bf16 from its fp32 mix sum_j comb[j, k] X_j (not yet rounded),
        post_k p and the block output y: eager's roundings, each term to bf16, then their sum (p y
        rounded by integer ops: a cast would be contracted into the add, _bf16_bits)."""
        return _bf16(_bf16(mixed, INTERPRETED).to(tl.float32) + _bf16_bits(p * y).to(tl.float32), INTERPRETED)

    @triton.jit
    def _combined_stream(y, k, rows, r_ok, cols, ok, x_ptr, post_ptr, comb_ptr, stride_xt, D,
                         N_HC: tl.constexpr, INTERPRETED: tl.constexpr):
        """Stream k of hc_combine, X'_k = post_k y + sum_j comb[j, k] X_j, for tokens `rows` [R] (r_ok)
        at columns `cols` [C] (ok [R, C]): y [R, C] the block output (fp32 values of bf16), the streams
        x [T, N_HC, D] (stride_xt a token), post [T, N_HC] and comb [T, N_HC, N_HC] fp32, rounded to
        bf16 here as hc_combine casts them; the sum over j in order -> [R, C] bf16 (`_combined`)."""
        mixed = tl.zeros_like(y)
        for j in tl.static_range(N_HC):
            c = _bf16(tl.load(comb_ptr + (rows * N_HC + j) * N_HC + k, mask=r_ok, other=0.0), INTERPRETED)
            x = tl.load(x_ptr + rows[:, None] * stride_xt + j * D + cols[None, :], mask=ok, other=0.0)
            mixed += c.to(tl.float32)[:, None] * x.to(tl.float32)
        p = _bf16(tl.load(post_ptr + rows * N_HC + k, mask=r_ok, other=0.0), INTERPRETED).to(tl.float32)
        return _combined(mixed, p[:, None], y, INTERPRETED)

    @triton.jit
    def _stream_mix_kernel(comb_ptr, x_ptr, post_ptr, y_ptr, out_ptr, D, N: tl.constexpr, K: tl.constexpr,
                           ROUND: tl.constexpr, POST: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """out_k = sum_j comb[j, k] X_j, plus post_k y where POST (each term rounded to X's dtype,
        then their sum: the eager ops' roundings)."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = d < D
        if POST:
            y = tl.load(y_ptr + t * D + d, mask=ok, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(N):
                c = tl.load(comb_ptr + t * N * K + j * K + k).to(tl.float32)
                x = tl.load(x_ptr + (t * N + j) * D + d, mask=ok, other=0.0).to(tl.float32)
                acc += c * x
            if POST:
                p = tl.load(post_ptr + t * K + k).to(tl.float32)
                if ROUND:
                    tl.store(out_ptr + (t * K + k) * D + d, _combined(acc, p, y, INTERPRETED), mask=ok)
                else:
                    tl.store(out_ptr + (t * K + k) * D + d, acc + p * y, mask=ok)
            elif ROUND:
                tl.store(out_ptr + (t * K + k) * D + d, _bf16(acc, INTERPRETED), mask=ok)
            else:
                tl.store(out_ptr + (t * K + k) * D + d, acc, mask=ok)

    def _check_dtype(op: str, streams: torch.Tensor) -> None:
        if streams.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"lockstep::{op}: streams must be bf16 or fp32, got {streams.dtype}")

    @torch.library.triton_op("lockstep::stream_mix", mutates_args=())
    def stream_mix_op(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """comb [T, n, K], streams [T, n, D] (bf16 or fp32) -> comb^T @ X per token [T, K, D], streams' dtype."""
        _check_dtype("stream_mix", streams)
        return _mix(comb.contiguous(), streams.contiguous(), None, None)

    def _mix(comb, x, post, y):
        """The mix kernel's launch: post and y None for the mix alone."""
        T, n, D = x.shape
        K = comb.shape[-1]
        out = x.new_empty(T, K, D)
        if out.numel():
            torch.library.wrap_triton(_stream_mix_kernel)[(T, triton.cdiv(D, MIX_BLOCK))](
                comb, x, x if post is None else post, x if y is None else y, out, D, N=n, K=K,
                ROUND=x.dtype == torch.bfloat16, POST=post is not None, INTERPRETED=_gt.interpreted(), BLOCK=MIX_BLOCK)
        return out

    @torch.library.triton_op("lockstep::stream_combine", mutates_args=())
    def stream_combine_op(comb: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """comb [T, n, K], streams [T, n, D], post [T, K], y [T, D] -> post_k y + comb^T @ X [T, K, D]."""
        _check_dtype("stream_combine", streams)
        return _mix(comb.contiguous(), streams.contiguous(), post.contiguous(), y.contiguous())

    @stream_combine_op.register_fake
    def _(comb, streams, post, y):
        return streams.new_empty(streams.shape[0], comb.shape[-1], streams.shape[-1])

    @triton.jit
    def _stream_combine_backward_kernel(comb_ptr, x_ptr, post_ptr, y_ptr, g_ptr, dx_ptr, dy_ptr, dpost_ptr,
                                        dcomb_ptr, D, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
                                        ROUND: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """One token per program, its [N, D] streams, [K, D] gradient and y read once, as two small
        products per BLOCK columns on the tensor cores (rows padded to R >= 16, the smallest MMA tile):
            X' = [X_0 .. X_{N-1}, y, 0 ..] [R, BLOCK],  G' = [g_0 .. g_{K-1}, 0 ..] [R, BLOCK]
            X' G'^T  accumulates d comb[j, k] = sum_d X_j g_k (rows < N) and d post_k = sum_d g_k y (row N)
            C' G'    with C' = [comb; post; 0] [R, R]: d X_j = sum_k comb[j, k] g_k (rows < N) and
                     d y = sum_k post_k g_k (row N), rounded to X's dtype
        bf16 products are exact in the fp32 accumulators: the fp32 sums the eager ops take, in the MMA's
        order. Written as broadcast products reduced over D in every pass, this was 0.82 ms a call at
        16,384 x 4 x 1,024 on an H200 (0.14 of its bytes' copy time); as products, 0.18 ms (0.62)."""
        t = tl.program_id(0).to(tl.int64)
        rows, cols, offs = tl.arange(0, R), tl.arange(0, R), tl.arange(0, BLOCK)
        is_x, is_y = rows[:, None] < N, rows[:, None] == N
        in_comb, in_post = is_x & (cols[None, :] < K), is_y & (cols[None, :] < K)
        c_at, p_at = t * N * K + rows[:, None] * K + cols[None, :], t * K + cols[None, :] + 0 * rows[:, None]
        c_mat = tl.where(is_y, tl.load(post_ptr + p_at, mask=in_post, other=0.0),
                         tl.load(comb_ptr + c_at, mask=in_comb, other=0.0))
        if INTERPRETED:  # the interpreter's dot multiplies bf16 bits as integers; fp32 products are the same
            c_mat = c_mat.to(tl.float32)
        acc = tl.zeros([R, R], dtype=tl.float32)
        for start in range(0, D, BLOCK):
            d = start + offs
            ok = d[None, :] < D
            x_at, y_at = (t * N + rows[:, None]) * D + d[None, :], t * D + d[None, :] + 0 * rows[:, None]
            x = tl.where(is_y, tl.load(y_ptr + y_at, mask=is_y & ok, other=0.0),
                         tl.load(x_ptr + x_at, mask=is_x & ok, other=0.0))
            g = tl.load(g_ptr + (t * K + rows[:, None]) * D + d[None, :], mask=(rows[:, None] < K) & ok, other=0.0)
            if ROUND and not INTERPRETED:
                acc = tl.dot(x, tl.trans(g), acc)
                d_xy = _bf16(tl.dot(c_mat, g), INTERPRETED)
            else:  # fp32 streams, or the interpreter: fp32 products, not tf32
                x, g = x.to(tl.float32), g.to(tl.float32)
                acc = tl.dot(x, tl.trans(g), acc, input_precision="ieee")
                d_xy = tl.dot(c_mat, g, input_precision="ieee")
                if ROUND:
                    d_xy = _bf16(d_xy, INTERPRETED)
            tl.store(dx_ptr + x_at, d_xy, mask=is_x & ok)
            tl.store(dy_ptr + y_at, d_xy, mask=is_y & ok)
        tl.store(dcomb_ptr + c_at, acc, mask=in_comb)
        tl.store(dpost_ptr + p_at, acc, mask=in_post)

    # hidden elements per pass, and one warp a token: on an H200 (16,384 x 4 x 1,024, bf16) 0.18 ms,
    # against 0.21 with 2 warps x 256 and 0.26 with 4 x 256; pipelining the passes (num_stages) was slower
    COMBINE_BACKWARD_BLOCK, COMBINE_BACKWARD_WARPS = 128, 1

    def _mma_rows(n: int, K: int) -> int:
        """The backward's padded rows: the n streams and y, the K gradients, at least one MMA tile."""
        return max(16, triton.next_power_of_2(max(n + 1, K)))

    @torch.library.triton_op("lockstep::stream_combine_backward", mutates_args=())
    def stream_combine_backward_op(comb: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, y: torch.Tensor,
                                   grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (d streams [T, n, D], d y [T, D] in the streams' dtype, d post [T, K], d comb [T, n, K] fp32)."""
        _check_dtype("stream_combine_backward", streams)
        comb, x, post, y, g = (t.contiguous() for t in (comb, streams, post, y, grad))
        T, n, D = x.shape
        K = comb.shape[-1]
        d_x, d_y = torch.empty_like(x), torch.empty_like(y)
        d_post = post.new_empty(T, K, dtype=torch.float32)
        d_comb = comb.new_empty(T, n, K, dtype=torch.float32)
        if T:
            torch.library.wrap_triton(_stream_combine_backward_kernel)[(T,)](
                comb, x, post, y, g, d_x, d_y, d_post, d_comb, D, N=n, K=K, R=_mma_rows(n, K),
                ROUND=x.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(), BLOCK=COMBINE_BACKWARD_BLOCK,
                num_warps=COMBINE_BACKWARD_WARPS)
        return d_x, d_y, d_post, d_comb

    @stream_combine_backward_op.register_fake
    def _(comb, streams, post, y, grad):
        T, n, _ = streams.shape
        K = comb.shape[-1]
        return (torch.empty_like(streams), torch.empty_like(y), post.new_empty(T, K, dtype=torch.float32),
                comb.new_empty(T, n, K, dtype=torch.float32))

    # shapes for torch.compile's tracing, written out (grouped_gemm_triton.py says why)
    @stream_mix_op.register_fake
    def _(comb, streams):
        return streams.new_empty(streams.shape[0], comb.shape[-1], streams.shape[-1])

    @triton.jit
    def _collapse_backward_kernel(pre_ptr, x_ptr, g_ptr, add_ptr, dx_ptr, dpre_ptr, D, N: tl.constexpr,
                                  ADD: tl.constexpr, ROUND: tl.constexpr, INTERPRETED: tl.constexpr,
                                  BLOCK: tl.constexpr):
        """One token per program: d X_i = pre_i g (+ the addend's X_i with ADD, summed in fp32; rounded to
        X's dtype), d pre_i = sum_d g X_i (fp32)."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        for i in tl.static_range(N):
            p = tl.load(pre_ptr + t * N + i).to(tl.float32)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, D, BLOCK):
                d = start + offs
                ok = d < D
                g = tl.load(g_ptr + t * D + d, mask=ok, other=0.0).to(tl.float32)
                x = tl.load(x_ptr + (t * N + i) * D + d, mask=ok, other=0.0).to(tl.float32)
                acc += g * x
                dx = p * g
                if ADD:
                    dx = tl.load(add_ptr + (t * N + i) * D + d, mask=ok, other=0.0).to(tl.float32) + dx
                if ROUND:
                    tl.store(dx_ptr + (t * N + i) * D + d, _bf16(dx, INTERPRETED), mask=ok)
                else:
                    tl.store(dx_ptr + (t * N + i) * D + d, dx, mask=ok)
            tl.store(dpre_ptr + t * N + i, tl.sum(acc, axis=0))

    @torch.library.triton_op("lockstep::collapse_backward", mutates_args=())
    def collapse_backward_op(pre: torch.Tensor, streams: torch.Tensor, grad: torch.Tensor,
                             addend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """pre [T, n] fp32, streams [T, n, D], grad [T, D], addend [T, n, D] or None -> (d pre [T, n]
        fp32, d streams [T, n, D]: addend + pre_i grad)."""
        _check_dtype("collapse_backward", streams)
        pre, x, g = pre.float().contiguous(), streams.contiguous(), grad.contiguous()
        T, n, D = x.shape
        d_pre = pre.new_empty(T, n)
        d_x = torch.empty_like(x)
        if d_x.numel():
            torch.library.wrap_triton(_collapse_backward_kernel)[(T,)](
                pre, x, g, addend.contiguous() if addend is not None else x, d_x, d_pre, D, N=n, ADD=addend is not None,
                ROUND=x.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(), BLOCK=MIX_BLOCK)
        return d_pre, d_x

    @collapse_backward_op.register_fake
    def _(pre, streams, grad, addend=None):
        return pre.new_empty(streams.shape[0], streams.shape[1], dtype=torch.float32), torch.empty_like(streams)
