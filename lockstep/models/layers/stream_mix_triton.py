"""mHC's stream mix comb^T @ X per token, as the Triton custom op `lockstep::stream_mix`, and its
autograd (`StreamMix`) for the trainer's eager forward (hyper_connection.hc_combine).

    out[t, k, :] = sum_j comb[t, j, k] * X[t, j, :]      (j = 0 .. n-1 in order, fp32, one rounding)

Why a kernel: as a GEMM this is a batched call of one n x n by n x D product per token, and cuBLAS
runs a batch of 16,384 of them (4 x 4 by 4 x 1024, the 1b config at 8 x 2048 tokens) with small
wmma tiles in 1.25 ms, at ~5% of the copy bandwidth its bytes need: 40 ms of a 440 ms train step on
an H200 (forward and the streams' gradient, twice per layer). The kernel reads the streams once
and writes the mix once. Numerics are the bf16 GEMM's: bf16 products are exact in fp32, summed in
fp32 and rounded once; here the sum runs j = 0 .. n-1, as `stream_mix_reference` (the CPU
reference, and the path wherever Triton cannot run) does, so the two give the same bits.
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl


def stream_mix_reference(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """comb [T, n, n], streams [T, n, D] -> [T, n, D] in streams' dtype: sum_j comb[:, j, k] X_j."""
    terms = comb.float().unsqueeze(-1)  # [T, j, k, 1]
    x = streams.float()
    out = terms[:, 0] * x[:, 0:1]
    for j in range(1, streams.shape[1]):
        out = out + terms[:, j] * x[:, j:j + 1]
    return out.to(streams.dtype)


def stream_mix(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The kernel where it runs (CUDA, or the interpreter), the reference elsewhere."""
    if triton is not None and (streams.is_cuda or _gt.interpreted()):
        return stream_mix_op(comb, streams)
    return stream_mix_reference(comb, streams)


class StreamMix(torch.autograd.Function):
    """comb^T @ X per token with the kernel forward; backward: the streams' gradient is the same mix
    with comb transposed, comb's is X @ g^T (a batched GEMM whose [n, D] x [D, n] shape cuBLAS runs
    well: 0.17 ms at the size above). Saves what the GEMM's autograd saved: comb and the streams."""

    @staticmethod
    def forward(ctx, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(comb, streams)
        return stream_mix(comb, streams)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comb, streams = ctx.saved_tensors
        grad = grad.contiguous()
        grad_comb = torch.matmul(streams, grad.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
        grad_streams = stream_mix(comb.transpose(-1, -2).contiguous(), grad) if ctx.needs_input_grad[1] else None
        return grad_comb, grad_streams


MIX_BLOCK = 1024  # hidden elements per program


if triton is not None:
    _bf16 = _gt._bf16  # by name: torch.compile's compile worker cannot resolve a module alias

    @triton.jit
    def _stream_mix_kernel(comb_ptr, x_ptr, out_ptr, D, N: tl.constexpr, ROUND: tl.constexpr,
                           INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = d < D
        for k in tl.static_range(N):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(N):
                c = tl.load(comb_ptr + t * N * N + j * N + k).to(tl.float32)
                x = tl.load(x_ptr + (t * N + j) * D + d, mask=ok, other=0.0).to(tl.float32)
                acc += c * x
            if ROUND:
                tl.store(out_ptr + (t * N + k) * D + d, _bf16(acc, INTERPRETED), mask=ok)
            else:
                tl.store(out_ptr + (t * N + k) * D + d, acc, mask=ok)

    @torch.library.triton_op("lockstep::stream_mix", mutates_args=())
    def stream_mix_op(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """comb [T, n, n], streams [T, n, D] (bf16 or fp32) -> comb^T @ X per token, streams' dtype."""
        if streams.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"lockstep::stream_mix: streams must be bf16 or fp32, got {streams.dtype}")
        comb, x = comb.contiguous(), streams.contiguous()
        out = torch.empty_like(x)
        T, n, D = x.shape
        if out.numel():
            torch.library.wrap_triton(_stream_mix_kernel)[(T, triton.cdiv(D, MIX_BLOCK))](
                comb, x, out, D, N=n, ROUND=x.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(),
                BLOCK=MIX_BLOCK)
        return out

    # shapes for torch.compile's tracing, written out (grouped_gemm_triton.py says why)
    @stream_mix_op.register_fake
    def _(comb, streams):
        return torch.empty_like(streams)
