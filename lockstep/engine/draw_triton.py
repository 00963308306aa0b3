"""The sampler's draw (sampler.py defines it) as Triton kernels, for a batch whose rows share one
temperature T and none truncates (top-k / top-p off: an RL rollout's rows, and greedy ones): each
row's token and its logprob log_softmax(x / T)[token], from the fp32 logits x [M, V] read once
(greedy rows) or twice (sampled rows, and the chunk holding the token once more).

Why: torch's form is log_softmax over all [M, V] (a read and a write), then argmax (another read)
or exp, an fp64 cumsum and a search (three more passes, one of them writing 16 bytes a logit), and a
gather: at batch 64 and V 32,768 the greedy form alone took 8.7 + 9.9 us of one H100's 1b decode step
(docs/speed.md, session 41), latency-bound reductions over 8 MB.

How: the row is cut into BLOCK-wide chunks (BLOCK from V only, so a row's bits do not depend on the
batch); z = x / T (times 1 / T, as torch's CUDA division by a scalar does).
1. grid (M, chunks): a chunk's maximum, the first index holding it, and sum exp(z - chunk max);
2. sampled rows only, grid (M, chunks): the row's maximum and sum from its chunks' (each program
   combining them in the same order, so every program has the same bits), then the chunk's mass
   sum p_i in fp64, p_i = exp(logp_i) in fp32 as torch's form computes it;
3. grid (M,): the row's token: greedy (u < 0), the first chunk holding the row's maximum; sampled,
   the first chunk whose cumulative mass reaches u * total, then inside it the first index whose
   cumulative mass does (the inverse CDF, fp64 sums); its logprob (z_token - max) - log(sum).

Numerics: a greedy token is torch.argmax's, the first maximum, NaN counted above every number (a row
with a NaN draws its first NaN and a NaN logprob, as torch's form does). Logprobs and the masses are
torch's to fp32 / fp64 rounding, not bitwise (other summation orders): a sampled token can differ from
torch's form only where u * total falls within that rounding of a boundary between two tokens. The
true-on-policy forward, whose logprobs must be the trainer's bits, never takes the kernels
(KernelSwitches.triton_sampler). Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=16)
def inverse_temperature(T: float) -> float:
    """1 / T rounded to fp32, the factor torch's CUDA kernel multiplies by when dividing by a scalar."""
    return torch.tensor(1.0, dtype=torch.float32).div(torch.tensor(T, dtype=torch.float32)).item()


def draw(x: torch.Tensor, T: float = 1.0, u: torch.Tensor | None = None,
         block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, V] fp32 logits, one temperature T, u [M] fp64 uniforms, any stride (< 0: the row is greedy;
    None: all are) -> (tokens [M] int64, logprobs [M] fp32). A nonzero block overrides the chunk width."""
    M, V = x.shape
    cfg = launch_config(V)
    block = block or cfg["BLOCK"]
    chunks, inv_t = triton.cdiv(V, block), inverse_temperature(T)
    tokens = torch.empty(M, dtype=torch.int64, device=x.device)
    logp = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return tokens, logp
    sampled, block_c = u is not None, triton.next_power_of_2(chunks)
    part = torch.empty(2, M, chunks, dtype=torch.float32, device=x.device)  # chunk max, chunk sum
    part_index = torch.empty(M, chunks, dtype=torch.int32, device=x.device)
    strides = (V, x.stride(0), x.stride(1), M * chunks, chunks)
    common = dict(INTERPRETED=interpreted(), BLOCK=block, num_warps=cfg["num_warps"])
    _chunk_kernel[(M, chunks)](x, part, part_index, inv_t, *strides, **common)
    mass = part  # greedy rows read no mass (nor u): any tensor stands in for the pointers
    if sampled:
        mass = torch.empty(M, chunks, dtype=torch.float64, device=x.device)
        _chunk_mass_kernel[(M, chunks)](x, part, mass, inv_t, *strides, **common, BLOCK_C=block_c)
    _row_kernel[(M,)](x, part, part_index, mass, u if sampled else part, tokens, logp, inv_t, *strides,
                      u.stride(0) if sampled else 0, **common, SAMPLED=sampled, BLOCK_C=block_c)
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
        return libdevice.exp(x)  # expf, not tl.exp's ex2.approx

    @triton.jit
    def _log(x, INTERPRETED: tl.constexpr):
        if INTERPRETED:
            return tl.log(x)
        return libdevice.log(x)

    @triton.jit
    def _chunk(x_ptr, inv_t, m, c, V, stride_xm, stride_xv, BLOCK: tl.constexpr):
        """Chunk c of row m: z = x * (1 / T), -inf past V, and its columns."""
        cols = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + cols * stride_xv, mask=cols < V, other=float("-inf"))
        return x * inv_t, cols

    @triton.jit
    def _row_stats(part_ptr, m, PLANE, CHUNKS, INTERPRETED: tl.constexpr, BLOCK_C: tl.constexpr):
        """Row m's maximum and log sum exp(z - max) from its chunks' partials, in one fixed order, and
        the chunks' maxima."""
        c = tl.arange(0, BLOCK_C)
        ok = c < CHUNKS
        tops = tl.load(part_ptr + m * CHUNKS + c, mask=ok, other=float("-inf"))
        sums = tl.load(part_ptr + PLANE + m * CHUNKS + c, mask=ok, other=0.0)
        top = tl.max(tl.where(tops != tops, float("inf"), tops), axis=0)  # a NaN chunk: the row's sum is NaN
        total = tl.sum(sums * _exp(_offset(tops, top), INTERPRETED), axis=0)
        return top, _log(total, INTERPRETED), tops

    @triton.jit
    def _probs(z, top, log_total, INTERPRETED: tl.constexpr):
        """exp(logp) in fp32 as torch's form computes it: logp = (z - max) - log(sum)."""
        return _exp(_offset(z, top) - log_total, INTERPRETED)

    @triton.jit
    def _chunk_kernel(x_ptr, part_ptr, part_index_ptr, inv_t, V, stride_xm, stride_xv, PLANE, CHUNKS,
                      INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """Row m's chunk c: its (max, first index of it, sum exp(z - max)) at [m, c] of the partials."""
        m, c = tl.program_id(0), tl.program_id(1)
        z, cols = _chunk(x_ptr, inv_t, m, c, V, stride_xm, stride_xv, BLOCK)
        top, at = tl.reduce((z, tl.where(cols < V, cols, _NO_INDEX)), 0, _first_max)
        slot = m * CHUNKS + c
        tl.store(part_ptr + slot, top)
        tl.store(part_ptr + PLANE + slot, tl.sum(_exp(_offset(z, top), INTERPRETED), axis=0))  # masked: exp(-inf)
        tl.store(part_index_ptr + slot, at)

    @triton.jit
    def _chunk_mass_kernel(x_ptr, part_ptr, mass_ptr, inv_t, V, stride_xm, stride_xv, PLANE, CHUNKS,
                           INTERPRETED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
        """Row m's chunk c: its probability mass in fp64 at [m, c]."""
        m, c = tl.program_id(0), tl.program_id(1)
        top, log_total, _ = _row_stats(part_ptr, m, PLANE, CHUNKS, INTERPRETED, BLOCK_C)
        z, cols = _chunk(x_ptr, inv_t, m, c, V, stride_xm, stride_xv, BLOCK)
        p = _probs(z, top, log_total, INTERPRETED).to(tl.float64)
        tl.store(mass_ptr + m * CHUNKS + c, tl.sum(p, axis=0))

    @triton.jit
    def _row_kernel(x_ptr, part_ptr, part_index_ptr, mass_ptr, u_ptr, tokens_ptr, logp_ptr, inv_t, V, stride_xm,
                    stride_xv, PLANE, CHUNKS, stride_u, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr,
                    SAMPLED: tl.constexpr, BLOCK_C: tl.constexpr):
        """Row m's token (greedy: the first chunk holding the max; sampled: the inverse CDF) and logprob."""
        m = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        top, log_total, tops = _row_stats(part_ptr, m, PLANE, CHUNKS, INTERPRETED, BLOCK_C)
        at = tl.load(part_index_ptr + m * CHUNKS + c, mask=c < CHUNKS, other=_NO_INDEX)
        _, token = tl.reduce((tops, at), 0, _first_max)
        if SAMPLED:
            u = tl.load(u_ptr + m * stride_u)
            if u >= 0:
                token = _inverse_cdf(x_ptr, mass_ptr, inv_t, top, log_total, u, m, V, stride_xm, stride_xv, CHUNKS,
                                     INTERPRETED, BLOCK, BLOCK_C)
        z_token = tl.load(x_ptr + m.to(tl.int64) * stride_xm + token * stride_xv) * inv_t
        tl.store(tokens_ptr + m, token.to(tl.int64))
        tl.store(logp_ptr + m, _offset(z_token, top) - log_total)

    @triton.jit
    def _inverse_cdf(x_ptr, mass_ptr, inv_t, top, log_total, u, m, V, stride_xm, stride_xv, CHUNKS,
                     INTERPRETED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
        """The first index whose cumulative mass reaches u * the row's total: the chunk first, then inside
        it (the chunk's last index where rounding leaves none there; the last chunk where it leaves none)."""
        c = tl.arange(0, BLOCK_C)
        mass = tl.load(mass_ptr + m * CHUNKS + c, mask=c < CHUNKS, other=0.0)
        cum = tl.cumsum(mass, axis=0)
        target = u * tl.sum(mass, axis=0)
        chunk = tl.minimum(tl.min(tl.where((cum >= target) & (c < CHUNKS), c, CHUNKS - 1), axis=0), CHUNKS - 1)
        before = tl.sum(tl.where(c < chunk, mass, 0.0), axis=0)
        z, cols = _chunk(x_ptr, inv_t, m, chunk, V, stride_xm, stride_xv, BLOCK)
        inner = before + tl.cumsum(_probs(z, top, log_total, INTERPRETED).to(tl.float64), axis=0)
        last = tl.minimum(chunk * BLOCK + BLOCK - 1, V - 1)
        return tl.min(tl.where((inner >= target) & (cols < V), cols, last), axis=0)
