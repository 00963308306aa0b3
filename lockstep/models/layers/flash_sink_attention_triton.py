"""The trainer's attention (sink_attention.banded_sink_attention) as flash-style Triton kernels,
forward and backward: no score matrix in memory.

What it computes: for every query position p and head h of whole sequences from position 0,
    out_h(p) = sum_k softmax_k([l_h(p, k)..., sink_h]) v_k,   l_h(p, k) = q_h(p) . k_k * scale + bias(p, k)
over the keys of p's sliding window (p - W < k <= p) and, in the compressed layers, the compressed
entries (bias 0 or -inf: `entry_bias` [N, S, E], closed blocks or the indexer's top-k). K = V
(DeepSeek-V4's one shared KV head), so the heads of a position share their keys: a program takes
BLOCK_M rows of q viewed as [N, S * H, D] (row = position * H + head), whichever heads and
positions they are, and walks the key tiles the positions see (the window's, then the entries'),
with the online softmax started at the sink (running max = sink_h, running sum = 1: the sink only
adds mass to the denominator, and a row whose keys are all masked stays finite).

Why: the torch form (`sink_attention`) writes the fp32 scores of each block of W queries against
its 2 W window keys + E entries, then casts, scales, biases, concatenates the sink, subtracts the
max, exponentiates, casts back, and keeps the probabilities for the backward (the 1b config at
8 x 2048 tokens: [128, 16, 128, 768] per layer, ~15 passes over it forward and backward together;
the largest item of a train step's profile after the GEMMs). Here the scores live in registers.

Backward (FlashAttention-2's): the forward keeps the output and each row's log-sum-exp (sink
included); delta = rowsum(dO * O) (`row_dots`, one pass); P is recomputed tile by tile,
dS = P (dO . k - delta).
- `_dq_kernel`: query-major like the forward, dQ = scale sum_k dS k.
- `_dkv_kernel`: key-major, one key tile per program over the rows that see it, dK + dV together
  (K = V): d kv_k = scale sum_rows dS q + sum_rows P dO. The window keys' rows are the W + tile
  positions after them; an entry may be seen from any position, so its rows are split over
  SPLIT programs whose partial sums are added by torch in a fixed order (no atomics: the same bits
  every run).
- d sink_h = -sum_rows P_sink delta (P_sink = exp(sink_h - lse)), in torch.

Numerics: scores q . k in fp32 (bf16 products, fp32 accumulation: the reference rounds them to
bf16 first), probabilities rounded to bf16 before P V as the reference does; close to the torch
form to bf16 rounding, not its bits (tests/models/test_flash_sink_attention_triton.py, against
fp64). The true-on-policy forward does not use it (its bits are tiled_attention_triton's).

Where it runs (`runs`): CUDA, bf16, a gradient wanted (the trainer's eager forward), not under
torch.compile (a compiled trainer fuses the torch form); and the kernel switch `flash_attention`
(TrainConfig.flash_attention, kernel_switch.py; LOCKSTEP_FLASH_ATTENTION=0 / 1 overrides), on by
default on CUDA (an H200, 1b config: 1.13x the train step alone, peak 49.3 -> 44.4 GiB). CPU tests
run the kernels under TRITON_INTERPRET=1 in fp32 and bf16, the switch set to True.
"""

from __future__ import annotations

import torch

from lockstep.triton_support import trainer_kernel_takes

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_M = 64  # rows (position, head) per program: 4 positions of 16 heads
BLOCK_N = 64  # keys per tile
SPLIT = 16  # programs per entry tile in the backward: an entry's rows are all S * H


def runs(q: torch.Tensor, kv: torch.Tensor, enabled: bool | None) -> bool:
    """Whether the trainer's attention takes these kernels (see the module docstring)."""
    if triton is None or q.shape[-1] < 16 or q.dtype != kv.dtype:
        return False
    return trainer_kernel_takes(q, enabled) and torch.is_grad_enabled() and not torch.compiler.is_compiling()


def flash_banded_sink_attention(q: torch.Tensor, kv: torch.Tensor, window: int, sinks: torch.Tensor, scale: float,
                                entries: torch.Tensor | None = None, entry_bias: torch.Tensor | None = None,
                                compress_rate: int | None = None) -> torch.Tensor:
    """banded_sink_attention's arguments and result: q [N, S, H, D], kv [N, S, D], entries [N, E, D]
    with entry_bias [N, S, E] (0 / -inf; no gradient) -> [N, S, H, D]. compress_rate m: the
    entries are compressed blocks of m positions, and position p sees none past the closed ones
    (j < (p + 1) // m: closed_block_bias, and the indexer picks among those), so the kernels skip the
    rest: about half the entry tiles of a causal sequence. None: every entry tile is scored."""
    return FlashSinkAttention.apply(q, kv, sinks, entries, entry_bias, window, scale, compress_rate)


class FlashSinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, sinks, entries, entry_bias, window: int, scale: float, compress_rate: int | None):
        q, kv, sinks32 = q.contiguous(), kv.contiguous(), sinks.float().contiguous()
        if entries is not None:
            entries, entry_bias = entries.contiguous(), entry_bias.detach().float().contiguous()
        out, lse = _forward(q, kv, sinks32, entries, entry_bias, window, scale, compress_rate)
        ctx.save_for_backward(q, kv, sinks32, entries, entry_bias, out, lse)
        ctx.window, ctx.scale, ctx.compress_rate, ctx.sinks_dtype = window, scale, compress_rate, sinks.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, sinks32, entries, entry_bias, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        delta = row_dots(grad_out, out)  # [N, S, H]: sum_k P dP of each row
        dq, dkv, dentries = _backward(q, kv, sinks32, entries, entry_bias, grad_out, lse, delta, ctx.window, ctx.scale,
                                      ctx.compress_rate)
        # the sink's logit has no value: dS_sink = P_sink (0 - delta)
        dsinks = -(torch.exp(sinks32 - lse) * delta).sum((0, 1)).to(ctx.sinks_dtype)
        return dq, dkv, dsinks, dentries, None, None, None, None


DELTA_ROWS = 32  # rows per program of `row_dots`


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over the last dim of a * b in fp32, [...]: one pass over both (the products of bf16
    values exact in fp32). The torch form, (a.float() * b.float()).sum(-1), wrote both fp32 copies
    and the product first: ~0.36 ms a layer of the 1b config's backward at 8 x 2048 tokens on an
    H200 (profile of 2026-12-03: 2.9 ms of the graphed step in 16 copies, 8 products, 8 sums)."""
    D = a.shape[-1]
    a2, b2 = a.reshape(-1, D), b.reshape(-1, D)
    out = torch.empty(a2.shape[0], dtype=torch.float32, device=a.device)
    if out.numel():
        _row_dot_kernel[(triton.cdiv(out.numel(), DELTA_ROWS),)](a2, b2, out, out.numel(), D, BLOCK_R=DELTA_ROWS,
                                                                 BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return out.view(a.shape[:-1])


def _launch_args(q, kv, sinks, entries, entry_bias, compress_rate):
    """(N, S, E, whether there are entries, the entries' and their bias's pointers, the keyword
    arguments every kernel takes). Entries absent: kv and sinks stand in (never read). M, CLOSED:
    the compress rate, and whether the entries past the closed ones are skipped."""
    N, S, H, D = q.shape
    has_entries = entries is not None and entries.shape[1] > 0  # none closed yet: a window layer's work
    E = entries.shape[1] if has_entries else 0
    common = dict(M=compress_rate or 1, CLOSED=compress_rate is not None, H=H, D=D,
                  BLOCK_D=triton.next_power_of_2(D), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                  BF16=q.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(), num_warps=4)
    return N, S, E, has_entries, entries if has_entries else kv, entry_bias if has_entries else sinks, common


def _forward(q, kv, sinks, entries, entry_bias, window, scale, compress_rate):
    N, S, E, has_entries, ent, ebias, common = _launch_args(q, kv, sinks, entries, entry_bias, compress_rate)
    out = torch.empty_like(q)
    lse = torch.empty(N, S, q.shape[2], dtype=torch.float32, device=q.device)
    _fwd_kernel[(triton.cdiv(S * q.shape[2], BLOCK_M), N)](q, kv, ent, ebias, sinks, out, lse, S, E, window, scale,
                                                           HAS_ENTRIES=has_entries, **common)
    return out, lse


def _backward(q, kv, sinks, entries, entry_bias, grad_out, lse, delta, window, scale, compress_rate):
    N, S, E, has_entries, ent, ebias, common = _launch_args(q, kv, sinks, entries, entry_bias, compress_rate)
    dq = torch.empty_like(q)
    _dq_kernel[(triton.cdiv(S * q.shape[2], BLOCK_M), N)](q, kv, ent, ebias, grad_out, lse, delta, dq, S, E, window,
                                                          scale, HAS_ENTRIES=has_entries, **common)
    dkv = torch.empty_like(kv)
    _dkv_kernel[(triton.cdiv(S, BLOCK_N), 1, N)](q, kv, ebias, grad_out, lse, delta, dkv, S, S, E, window, scale,
                                                 ENTRIES=False, **common)
    dentries = None if entries is None else torch.zeros_like(entries)
    if has_entries:
        partial = torch.empty(SPLIT, N, E, q.shape[3], dtype=torch.float32, device=q.device)
        _dkv_kernel[(triton.cdiv(E, BLOCK_N), SPLIT, N)](q, ent, ebias, grad_out, lse, delta, partial, S, E, E,
                                                         window, scale, ENTRIES=True, **common)
        dentries = partial.sum(0).to(entries.dtype)  # the SPLIT parts added in index order
    return dq, dkv, dentries


if triton is not None:

    @triton.jit
    def _row_dot_kernel(a_ptr, b_ptr, out_ptr, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[r] = sum_d a[r, d] b[r, d] in fp32, BLOCK_R contiguous rows of length D <= BLOCK_D."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        ok = (rows < R)[:, None] & (cols < D)[None, :]
        at = rows[:, None].to(tl.int64) * D + cols[None, :]
        a = tl.load(a_ptr + at, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, tl.sum(a * b, axis=1), mask=rows < R)

    # by name: torch.compile's compile worker cannot resolve a module alias
    _dot, _bf16 = _gt._dot, _gt._bf16

    @triton.jit
    def _mm(a, b, INTERPRETED: tl.constexpr):
        """a @ b in fp32 (tiles of one dtype: bf16 on the GPU, bf16 or fp32 under the interpreter)."""
        return _dot(a, b, tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32), INTERPRETED)

    @triton.jit
    def _like_keys(x, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """x (fp32) rounded to the keys' dtype for a tensor-core product."""
        if BF16:  # one return: the compiler wants one type for both branches' results
            y = _bf16(x, INTERPRETED)
        else:
            y = x
        return y

    @triton.jit
    def _scores(q, k, pos, keys, S, W, ebias_row_ptr, E, scale, ENTRIES: tl.constexpr, INTERPRETED: tl.constexpr):
        """[rows, keys] scale * q . k with the mask as -inf: a window key is visible iff
        p - W < k <= p; an entry adds its bias (0 / -inf) at (p, entry)."""
        s = _mm(q, tl.trans(k), INTERPRETED) * scale
        if ENTRIES:
            b = tl.load(ebias_row_ptr + pos[:, None].to(tl.int64) * E + keys[None, :],
                        mask=(pos[:, None] < S) & (keys[None, :] < E), other=float("-inf"))
            s = s + b
        else:
            diff = pos[:, None] - keys[None, :]
            s = tl.where((diff >= 0) & (diff < W) & (keys[None, :] < S), s, float("-inf"))
        return s

    @triton.jit
    def _online_softmax(m, s_sum, acc, s, k, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        """One key tile into the running max m, sum s_sum and output acc of each row (scores s)."""
        new_m = tl.maximum(m, tl.max(s, axis=1))
        rescale = tl.exp(m - new_m)
        p = tl.exp(s - new_m[:, None])
        s_sum = s_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + _mm(_like_keys(p, BF16, INTERPRETED), k, INTERPRETED)
        return new_m, s_sum, acc

    @triton.jit
    def _entry_end(p_last, E, M, CLOSED: tl.constexpr):
        """Entries a program walks: all E, or (CLOSED) those closed by its last position, (p + 1) // M."""
        end = E
        if CLOSED:
            end = tl.minimum((p_last + 1) // M, E)
        return end

    @triton.jit
    def _query_block(S, W, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's sequence n, its rows of q as [S * H, D] (position-major), their positions,
        the first window key any of them sees, the last position among them (within S) and the
        head-dim offsets: the query-major kernels' prologue."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        p_first = tl.program_id(0) * BLOCK_M // H
        p_last = tl.minimum((tl.program_id(0) * BLOCK_M + BLOCK_M - 1) // H, S - 1)
        n = tl.program_id(1).to(tl.int64)
        return n, rows, rows // H, tl.maximum(p_first - W + 1, 0), p_last, tl.arange(0, BLOCK_D)

    @triton.jit
    def _rows(ptr, n, S, rows, rd, H: tl.constexpr, D: tl.constexpr):
        """A [rows, D] tile of a [N, S * H, D] tensor (zeros past its end or its head dim)."""
        ok = (rows[:, None] < S * H) & (rd[None, :] < D)
        return tl.load(ptr + (n * S * H + rows[:, None]) * D + rd[None, :], mask=ok, other=0.0)

    @triton.jit
    def _keys(ptr, n, L, keys, rd, D: tl.constexpr):
        """A [keys, D] tile of a [N, L, D] tensor (zeros past its end or its head dim)."""
        ok = (keys[:, None] < L) & (rd[None, :] < D)
        return tl.load(ptr + (n * L + keys[:, None]) * D + rd[None, :], mask=ok, other=0.0)

    @triton.jit
    def _fwd_kernel(q_ptr, kv_ptr, ent_ptr, ebias_ptr, sinks_ptr, out_ptr, lse_ptr, S, E, W, scale, M,
                    CLOSED: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ENTRIES: tl.constexpr, BF16: tl.constexpr,
                    INTERPRETED: tl.constexpr):
        scale = tl.cast(scale, tl.float32)
        n, rows, pos, k_first, p_last, rd = _query_block(S, W, H, BLOCK_M, BLOCK_D)
        q = _rows(q_ptr, n, S, rows, rd, H, D)
        m = tl.load(sinks_ptr + rows % H, mask=rows < S * H, other=0.0)  # the sink folded in first
        s_sum = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for k0 in range(k_first, p_last + 1, BLOCK_N):
            keys = k0 + tl.arange(0, BLOCK_N)
            k = _keys(kv_ptr, n, S, keys, rd, D)
            s = _scores(q, k, pos, keys, S, W, ebias_ptr, E, scale, False, INTERPRETED)
            m, s_sum, acc = _online_softmax(m, s_sum, acc, s, k, BF16, INTERPRETED)
        if HAS_ENTRIES:
            for e0 in range(0, _entry_end(p_last, E, M, CLOSED), BLOCK_N):
                ents = e0 + tl.arange(0, BLOCK_N)
                k = _keys(ent_ptr, n, E, ents, rd, D)
                s = _scores(q, k, pos, ents, S, W, ebias_ptr + n * S * E, E, scale, True, INTERPRETED)
                m, s_sum, acc = _online_softmax(m, s_sum, acc, s, k, BF16, INTERPRETED)
        out = _like_keys(acc / s_sum[:, None], BF16, INTERPRETED)
        ok = rows < S * H
        tl.store(out_ptr + (n * S * H + rows[:, None]) * D + rd[None, :], out, mask=ok[:, None] & (rd[None, :] < D))
        tl.store(lse_ptr + n * S * H + rows, m + tl.log(s_sum), mask=ok)

    @triton.jit
    def _ds(q, do, k, lse, delta, pos, keys, S, W, ebias_row_ptr, E, scale, ENTRIES: tl.constexpr,
            INTERPRETED: tl.constexpr):
        """P (recomputed from the row's log-sum-exp) and dS = P (dO . k - delta), [rows, keys]."""
        p = tl.exp(_scores(q, k, pos, keys, S, W, ebias_row_ptr, E, scale, ENTRIES, INTERPRETED) - lse[:, None])
        dp = _mm(do, tl.trans(k), INTERPRETED)  # V = K
        return p, p * (dp - delta[:, None])

    @triton.jit
    def _dq_kernel(q_ptr, kv_ptr, ent_ptr, ebias_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, S, E, W, scale, M,
                   CLOSED: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ENTRIES: tl.constexpr, BF16: tl.constexpr,
                   INTERPRETED: tl.constexpr):
        scale = tl.cast(scale, tl.float32)
        n, rows, pos, k_first, p_last, rd = _query_block(S, W, H, BLOCK_M, BLOCK_D)
        ok = rows < S * H
        q, do = _rows(q_ptr, n, S, rows, rd, H, D), _rows(do_ptr, n, S, rows, rd, H, D)
        lse = tl.load(lse_ptr + n * S * H + rows, mask=ok, other=0.0)
        delta = tl.load(delta_ptr + n * S * H + rows, mask=ok, other=0.0)
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for k0 in range(k_first, p_last + 1, BLOCK_N):
            keys = k0 + tl.arange(0, BLOCK_N)
            k = _keys(kv_ptr, n, S, keys, rd, D)
            _, ds = _ds(q, do, k, lse, delta, pos, keys, S, W, ebias_ptr, E, scale, False, INTERPRETED)
            dq += _mm(_like_keys(ds, BF16, INTERPRETED), k, INTERPRETED)
        if HAS_ENTRIES:
            for e0 in range(0, _entry_end(p_last, E, M, CLOSED), BLOCK_N):
                ents = e0 + tl.arange(0, BLOCK_N)
                k = _keys(ent_ptr, n, E, ents, rd, D)
                _, ds = _ds(q, do, k, lse, delta, pos, ents, S, W, ebias_ptr + n * S * E, E, scale, True, INTERPRETED)
                dq += _mm(_like_keys(ds, BF16, INTERPRETED), k, INTERPRETED)
        dq = _like_keys(dq * scale, BF16, INTERPRETED)
        tl.store(dq_ptr + (n * S * H + rows[:, None]) * D + rd[None, :], dq, mask=ok[:, None] & (rd[None, :] < D))

    @triton.jit
    def _dkv_kernel(q_ptr, k_ptr, ebias_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, S, L, E, W, scale, M,
                    CLOSED: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ENTRIES: tl.constexpr, BF16: tl.constexpr,
                    INTERPRETED: tl.constexpr):
        """One tile of L keys (the window's kv, L = S, or the entries, L = E) against the rows that
        see it. ENTRIES: program_id(1) takes its share of all S * H rows and writes an fp32 partial
        sum [SPLIT, N, E, D]; else the rows of positions k0 .. k0 + BLOCK_N + W - 2, written as dkv."""
        scale = tl.cast(scale, tl.float32)
        n = tl.program_id(2).to(tl.int64)
        keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rd = tl.arange(0, BLOCK_D)
        k = _keys(k_ptr, n, L, keys, rd, D)
        acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        if ENTRIES:
            r_min = 0  # the first row that can see the tile: its first entry's block closes at (e0 + 1) m - 1
            if CLOSED:
                r_min = tl.minimum(((tl.program_id(0) * BLOCK_N + 1) * M - 1) * H, S * H)
            share = tl.cdiv(tl.cdiv(S * H - r_min, BLOCK_M), tl.num_programs(1)) * BLOCK_M
            r_first = r_min + tl.program_id(1) * share
            r_end = tl.minimum(r_first + share, S * H)
        else:
            r_first = tl.program_id(0) * BLOCK_N * H
            r_end = tl.minimum((tl.program_id(0) * BLOCK_N + BLOCK_N + W - 1) * H, S * H)
        for r0 in range(r_first, r_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            ok = rows < r_end
            q, do = _rows(q_ptr, n, S, rows, rd, H, D), _rows(do_ptr, n, S, rows, rd, H, D)
            lse = tl.load(lse_ptr + n * S * H + rows, mask=ok, other=float("inf"))  # rows past the end: P = 0
            delta = tl.load(delta_ptr + n * S * H + rows, mask=ok, other=0.0)
            p, ds = _ds(q, do, k, lse, delta, rows // H, keys, S, W, ebias_ptr + n * S * E, E, scale, ENTRIES,
                        INTERPRETED)
            acc += _mm(tl.trans(_like_keys(ds * scale, BF16, INTERPRETED)), q, INTERPRETED)  # as a key
            acc += _mm(tl.trans(_like_keys(p, BF16, INTERPRETED)), do, INTERPRETED)  # as a value
        ok = (keys[:, None] < L) & (rd[None, :] < D)
        if ENTRIES:
            base = (tl.program_id(1) * tl.num_programs(2) + n) * L
            tl.store(dk_ptr + (base + keys[:, None]) * D + rd[None, :], acc, mask=ok)
        else:
            tl.store(dk_ptr + (n * L + keys[:, None]) * D + rd[None, :], _like_keys(acc, BF16, INTERPRETED), mask=ok)
