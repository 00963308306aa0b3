"""A greedy draw as two Triton kernels: each row's token, the first maximum of its fp32 logits x [V],
and the logprob the sampler records for it, log_softmax(x)[token] = -log(sum exp(x - max x)), from
one read of the logits (sampler.py defines both; this is its greedy rows' form at temperature 1).

Why: torch's form is log_softmax over all [M, V] (a read and a write), argmax (another read) and a
gather: 8.7 + 9.9 us of one H100's 1b decode step (batch 64, V 32,768; docs/speed.md, session 41),
latency-bound reductions over 8 MB that one pass over the rows covers.

How: stage 1, grid (M, cdiv(V, BLOCK)): a program loads one BLOCK-wide chunk of a row and writes its
chunk's maximum, the first index holding it and sum exp(x - chunk max). Stage 2, one program a row:
the row's maximum over its chunks, the first chunk holding it gives the token, and the sum is
sum_c s_c exp(m_c - max). BLOCK depends on V only, so a row's bits do not depend on the batch.

Numerics: the token is torch.argmax's, the first maximum, NaN counted above every number (so a row
with a NaN draws its first NaN and a NaN logprob, as torch's form does). The logprob is log_softmax's
to fp32 rounding, not bitwise (another order of the sum, each term an exp of a chunk's and a row's
offset): the true-on-policy forward, whose logprobs must be the trainer's bits, never takes it
(KernelSwitches.triton_sampler). Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from lockstep.triton_support import interpreted, load_triton

triton = load_triton()
if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

NO_INDEX = 2**31 - 1  # a masked lane's index: after every real one


def runs(x: torch.Tensor, enabled: bool) -> bool:
    """Whether fp32 logits x [M, V] take the kernels: switched on, on CUDA (the tests call them under
    the interpreter)."""
    return triton is not None and enabled and x.is_cuda and x.dim() == 2 and x.dtype == torch.float32 \
        and x.shape[1] < NO_INDEX


def launch_config(V: int) -> dict:
    """Chunks of up to 2,048 logits (16 a row at V 32,768), 4 warps. Not tuned."""
    return dict(BLOCK=min(2048, max(16, triton.next_power_of_2(V))), num_warps=4)


def greedy_draw(x: torch.Tensor, block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, V] fp32 -> (tokens [M] int64, logprobs [M] fp32); a nonzero block overrides the chunk."""
    M, V = x.shape
    block = block or launch_config(V)["BLOCK"]
    chunks = triton.cdiv(V, block)
    tokens = torch.empty(M, dtype=torch.int64, device=x.device)
    logp = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return tokens, logp
    part_max = torch.empty(2, M, chunks, dtype=torch.float32, device=x.device)  # chunk max, chunk sum
    part_index = torch.empty(M, chunks, dtype=torch.int32, device=x.device)
    _chunk_kernel[(M, chunks)](x, part_max, part_index, V, x.stride(0), x.stride(1), M * chunks, chunks,
                               INTERPRETED=interpreted(), BLOCK=block, num_warps=4)
    _row_kernel[(M,)](part_max, part_index, tokens, logp, M * chunks, chunks,
                      INTERPRETED=interpreted(), BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)
    return tokens, logp


if triton is not None:
    _NO_INDEX = tl.constexpr(NO_INDEX)

    @triton.jit
    def _first_max(v1, i1, v2, i2):
        """tl.reduce's combine: the larger value, the earlier index among equals, NaN above all."""
        nan1, nan2 = v1 != v1, v2 != v2
        earlier2 = i2 < i1
        pick2 = tl.where(nan1 | nan2, nan2 & (~nan1 | earlier2), (v2 > v1) | ((v2 == v1) & earlier2))
        return tl.where(pick2, v2, v1), tl.where(pick2, i2, i1)

    @triton.jit
    def _offset(x, top):
        """x - top, -inf where x is (not NaN where top is -inf too: a row of -inf, or masked lanes)."""
        return x - tl.where(x == float("-inf"), 0.0, top)

    @triton.jit
    def _exp(x, INTERPRETED: tl.constexpr):
        if INTERPRETED:  # which has no libdevice
            return tl.exp(x)
        return libdevice.exp(x)  # the correctly rounded-ish expf, not tl.exp's ex2.approx

    @triton.jit
    def _chunk_kernel(x_ptr, part_max_ptr, part_index_ptr, V, stride_xm, stride_xv, PLANE, CHUNKS,
                      INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """Row m's chunk c: its (max, first index of it, sum exp(x - max)) at [m, c] of the partials."""
        m, c = tl.program_id(0), tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + cols * stride_xv, mask=ok, other=float("-inf"))
        top, at = tl.reduce((x, tl.where(ok, cols, _NO_INDEX)), 0, _first_max)
        e = _exp(_offset(x, top), INTERPRETED)  # masked lanes hold -inf: exp 0
        slot = m * CHUNKS + c
        tl.store(part_max_ptr + slot, top)
        tl.store(part_max_ptr + PLANE + slot, tl.sum(e, axis=0))
        tl.store(part_index_ptr + slot, at)

    @triton.jit
    def _row_kernel(part_max_ptr, part_index_ptr, tokens_ptr, logp_ptr, PLANE, CHUNKS,
                    INTERPRETED: tl.constexpr, BLOCK_C: tl.constexpr):
        """Row m's token (the first chunk holding its max: that chunk's index) and -log(sum)."""
        m = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        ok = c < CHUNKS
        slot = m * CHUNKS + c
        tops = tl.load(part_max_ptr + slot, mask=ok, other=float("-inf"))
        sums = tl.load(part_max_ptr + PLANE + slot, mask=ok, other=0.0)
        at = tl.load(part_index_ptr + slot, mask=ok, other=_NO_INDEX)
        top, token = tl.reduce((tops, at), 0, _first_max)
        scaled = sums * _exp(_offset(tops, top), INTERPRETED)
        total = tl.sum(scaled, axis=0)
        if INTERPRETED:
            log_total = tl.log(total)
        else:
            log_total = libdevice.log(total)
        tl.store(tokens_ptr + m, token.to(tl.int64))
        tl.store(logp_ptr + m, -log_total)
