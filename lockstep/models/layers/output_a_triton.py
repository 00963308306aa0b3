"""A decode step's attention output up to the grouped projection as one Triton kernel, registered
as the custom op `lockstep::derope_output_a`: V's rotary embedding undone, then DeepSeek-V4's
grouped output projection wo_a (attention.GroupedLinear, or its packed fp8 form, fp8_linear.py).

What, per token (attention.DeepseekV4Attention._output has the torch form):
    o'  = o with the trailing ROPE channels of each head rotated back (rope.apply_rope with -sin,
          cos / sin of position * inv_freq, in fp32), rounded to bf16
    out[g] = o'[heads of group g, flattened] @ W_g^T    (W_g: rows g N ... (g+1) N of wo_a)
A program owns BLOCK_M tokens x BLOCK_N columns of one group and walks the group's K = heads / G x
D inputs in BLOCK_K steps; each step loads its o tile, splits it into even and odd channels (the
rotation's pairs), rotates the ROPE channels in registers and runs a bf16 tl.dot with fp32
accumulation (W8A16: e4m3 bytes times their 128 x 128 block's power-of-two scale first, exact in
bf16, as fp8_linear.py's kernel does). A step may span heads and scale columns (launch_config's
default: 512 inputs, the 1b config's whole group in one step: the kernel is latency-bound), and K may
be split over SPLIT_K programs whose fp32 partials sum_splits_triton's kernel adds in order.

Why: compiled, the same is five kernels in the 1b decode step (the rotation with cos / sin
recomputed, the concatenation of the rotated and plain channels, the einsum's permuted copy in,
cuBLAS's batched GEMM, the permuted copy out), ~10 us of device time and ~2 us idle between them
a layer on one H200 (`rollout_throughput.py --step-trace`, 2026-12-04); fp8 three (the rotation,
the concatenation, the fp8 GEMM). With this kernel the bf16 step went 273 -> 241 kernels and 1,218
-> 1,192 us of device time, decode 46,765 -> 47,883 tok/s (0.317 of the roofline); the kernel took
7.8-8.9 us a call there (launch_config has the benchmark's figures).

Numerics: the rotation is apply_rope's products in fp32 on the same cos / sin (the caller's: at a
decode step those qk_norm_rope_triton's kernel computed, rope_cos_sin's bits), rounded once to bf16 (a GPU
compiler may contract a product and the add into an fma); the GEMM sums in another order than
cuBLAS: the torch form's result to bf16 rounding, not bitwise (tests/models/test_output_a_triton.py).
The true-on-policy forward never takes it.

Where (`runs`): DeepseekV4Attention.forward_step at a decode step (one new token per sequence) on
CUDA without gradients, bf16 activations, the `triton_attention` switch on (the step attention
kernel's conditions: the kernel reads that kernel's output). Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from lockstep.quant.fp8 import FP8_BLOCK

from . import fp8_linear, rope_triton
from . import sum_splits_triton as _ss
from . import grouped_gemm_triton as _gt
from .kernel_switch import forward_kernel_allowed

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_M = 16  # tokens per program: tl.dot's minimum
BLOCK_K = 512  # inputs per step by default (launch_config)


def runs(o: torch.Tensor, enabled: bool) -> bool:
    """Whether a step's attention output o [N, S, H, D] takes the kernel (module docstring)."""
    return (triton is not None and forward_kernel_allowed(enabled, o) and o.dim() == 4 and o.shape[1] == 1
            and o.dtype == torch.bfloat16)


def launch_config(N: int, K: int) -> dict:
    """32 output columns a program (the 1b config's 256 a group: 4 x 8 x 4 programs at 64 tokens),
    512 inputs a step (a group's whole K at the 1b config: 4 heads, 4 fp8 scale columns), 4 warps, no
    pipelining, K not split. Swept on one H100 (benchmarks/output_a.py --sweep, 1b shapes, batch 64,
    2026-12-05, us a call in CUDA graphs): bf16 5.58 against 6.48 with 128 inputs a step (split K 4:
    5.54, not worth its second kernel), fp8 6.92 against 6.96; the compiled torch form 5.65 / 8.84.
    An H200 sweep (2026-12-04, 128 inputs a step) gave 6.9 / 7.3 against the compiled form's 10.9 / 8.8."""
    return dict(BLOCK_N=min(32, max(16, triton.next_power_of_2(N))),
                BLOCK_K=min(BLOCK_K, max(16, triton.next_power_of_2(K))), num_warps=4, num_stages=1, SPLIT_K=1)


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _dot, _bf16 = _gt._dot, _gt._bf16
    _dequantize, _dequantize_tile = fp8_linear._dequantize, fp8_linear._dequantize_tile
    _grouped_tile = fp8_linear._grouped_tile
    _rotate_pairs = rope_triton._rotate_pairs

    @triton.jit
    def _derope_tile(o_tile, cos_ptr, sin_ptr, rm, k0, K, m_ok, stride_cm, D: tl.constexpr, ROPE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
        """The [BLOCK_M, BLOCK_K] tile of o at inputs k0 ... (a group's, head-major) with each head's
        trailing ROPE channels rotated back (apply_rope with -sin: its products, in fp32), as bf16.
        The tile is split into its even and odd channels in registers (one contiguous load)."""
        k_ok = k0 + tl.arange(0, BLOCK_K) < K
        x = tl.load(o_tile, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        pair = (k0 + 2 * tl.arange(0, BLOCK_K // 2)) % D  # a pair's first channel within its head (D even)
        rotated = (pair >= D - ROPE) & (k0 + 2 * tl.arange(0, BLOCK_K // 2) < K)
        at = rm[:, None] * stride_cm + ((pair - (D - ROPE)) // 2)[None, :]
        both = m_ok[:, None] & rotated[None, :]
        cos = tl.load(cos_ptr + at, mask=both, other=1.0)
        sin = -tl.load(sin_ptr + at, mask=both, other=0.0)
        return _bf16(_rotate_pairs(x, cos, sin, rotated, BLOCK_M, BLOCK_K), INTERPRETED)

    @triton.jit
    def _derope_output_a_kernel(o_ptr, cos_ptr, sin_ptr, w_ptr, s_ptr, srow_ptr, out_ptr, M, N, K, K_SPLIT,
                                stride_om, stride_og, stride_cm, stride_wn, stride_wk, stride_sr, stride_sc,
                                stride_split, stride_outm, stride_outg, stride_outn,
                                D: tl.constexpr, ROPE: tl.constexpr, FP8: tl.constexpr, SCALE_COLS: tl.constexpr,
                                INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        """out[m, g, n] = derope(o)[m, g, :] . w[g N + n, :] (times its block scale where FP8); o's
        inputs contiguous (stride 1 along K). SPLIT_K > 1: grid axis 2 runs over groups x splits, split s
        sums inputs s K_SPLIT ... (s + 1) K_SPLIT into the fp32 partials out[s] (added in order after)."""
        rm, rn, g, rk, m_ok, n_ok, row = _grouped_tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
        split = g % SPLIT_K
        g = g // SPLIT_K
        row = g * N + rn
        o_tile = o_ptr + rm[:, None].to(tl.int64) * stride_om + g * stride_og + rk[None, :]
        w_tile = w_ptr + row[None, :].to(tl.int64) * stride_wn + rk[:, None] * stride_wk  # [BLOCK_K, BLOCK_N] of w^T
        if FP8:
            s_rows = s_ptr + tl.load(srow_ptr + row, mask=n_ok, other=0).to(tl.int64) * stride_sr
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(split * K_SPLIT, tl.minimum((split + 1) * K_SPLIT, K), BLOCK_K):
            k_ok = k0 + rk < K
            a = _derope_tile(o_tile + k0, cos_ptr, sin_ptr, rm, k0, K, m_ok, stride_cm, D, ROPE, BLOCK_M, BLOCK_K,
                             INTERPRETED)
            w = tl.load(w_tile + k0 * stride_wk, mask=n_ok[None, :] & k_ok[:, None], other=0)
            if FP8 and BLOCK_K <= SCALE_COLS:  # the step within one scale column: one scale a weight row
                w = _dequantize_tile(w, tl.load(s_rows + (k0 // SCALE_COLS) * stride_sc, mask=n_ok, other=0.0))
            elif FP8:  # a step across scale columns: each input's own
                s = tl.load(s_rows[None, :] + ((k0 + rk) // SCALE_COLS)[:, None] * stride_sc,
                            mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                w = _dequantize(w, s)
            acc = _dot(a, w, acc, INTERPRETED)
        out = out_ptr + split * stride_split + rm[:, None].to(tl.int64) * stride_outm + g * stride_outg \
            + rn[None, :] * stride_outn
        if SPLIT_K == 1:
            tl.store(out, _bf16(acc, INTERPRETED), mask=m_ok[:, None] & n_ok[None, :])
        else:
            tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])

    @torch.library.triton_op("lockstep::derope_output_a", mutates_args=())
    def derope_output_a(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                        n_groups: int, scale: torch.Tensor | None = None, scale_row: torch.Tensor | None = None,
                        block_n: int = 0, block_k: int = 0, num_warps: int = 0, num_stages: int = 0,
                        split_k: int = 0) -> torch.Tensor:
        """o [M, H, D] bf16 (the attention's output), cos / sin [M, ROPE / 2] fp32 (rope.rope_cos_sin of
        the tokens' positions), weight [G N, H D / G] (bf16, or e4m3 bytes as uint8 with scale [R,
        ceil(K / 128)] fp32 and scale_row [G N] int32, fp8_linear.py's storage), n_groups G ->
        [M, G, N] bf16. Nonzero launch settings override launch_config's (benchmarks/output_a.py --sweep);
        split_k > 1 sums K in that many fp32 parts, added in order by sum_splits_triton's kernel (fixed by
        the setting, not the batch: a row's bits do not depend on it)."""
        M, H, D = o.shape
        G = n_groups
        N, K = weight.shape[0] // G, H * D // G
        fp8 = scale is not None
        cfg = launch_config(N, K)
        for key, value in (("BLOCK_N", block_n), ("BLOCK_K", block_k), ("num_warps", num_warps),
                           ("num_stages", num_stages), ("SPLIT_K", split_k)):
            cfg[key] = value or cfg[key]
        assert not fp8 or (FP8_BLOCK[1] % cfg["BLOCK_K"] == 0 or cfg["BLOCK_K"] % FP8_BLOCK[1] == 0), \
            "a K step must lie within one scale column or span whole ones"
        x = o.reshape(M, G, K).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        k_split = triton.cdiv(triton.cdiv(K, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        cfg["SPLIT_K"] = splits = triton.cdiv(K, k_split)  # none empty
        out = o.new_empty(M, G, N) if splits == 1 else o.new_empty(splits, M, G, N, dtype=torch.float32)
        if M:
            s_ptr, srow_ptr, stride_sr, stride_sc = (scale, scale_row, *scale.stride()) if fp8 else (cos, cos, 0, 0)
            torch.library.wrap_triton(_derope_output_a_kernel)[
                (triton.cdiv(M, BLOCK_M), triton.cdiv(N, cfg["BLOCK_N"]), G * splits)](
                x, cos, sin, weight, s_ptr, srow_ptr, out, M, N, K, k_split, x.stride(0), x.stride(1), cos.stride(0),
                *weight.stride(), stride_sr, stride_sc, out.stride(0) if splits > 1 else 0, *out.stride()[-3:],
                D=D, ROPE=2 * cos.shape[1], FP8=fp8, SCALE_COLS=FP8_BLOCK[1], INTERPRETED=_gt.interpreted(),
                BLOCK_M=BLOCK_M, **cfg)
        return out if splits == 1 else _ss.launch_sum_splits(out, out_bf16=True)

    # shapes for torch.compile's tracing, written out (step_attention_triton.py says why)
    @derope_output_a.register_fake
    def _(o, cos, sin, weight, n_groups, scale=None, scale_row=None, *config):
        return o.new_empty(o.shape[0], n_groups, weight.shape[0] // n_groups)
