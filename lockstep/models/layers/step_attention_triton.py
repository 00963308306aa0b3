"""A decode step's core attention (sink_attention.sink_attention with one query position) as one
Triton kernel, registered as the custom op `lockstep::sink_attention_step`.

What: out_h = sum_k softmax_k([l_h(k)..., sink_h]) v_k, l_h(k) = q_h . k_k * scale + bias(k), for
each sequence's one new token, over the keys the step assembled (window ring, the token itself,
compressed entries; bias 0 or -inf says which it sees). K = V (one shared KV head), so a
program takes one sequence: its H heads' queries as an [H, D] tile against [BLOCK_K, D] key tiles.

Why: in the compiled decode step (1b config, batch 64, one H200, 2026-12-03) the torch form was
4-10 launches per layer: the scores' batched GEMM, the softmax (in the window layers 8 kernels,
~16 us: inductor splits the reduction over the key axis, whose length is a symbol to it), the
probabilities' GEMM; at ~2 us a launch a decode step is latency-bound (~600 kernels, 0.20 of the
bandwidth roofline). benchmarks/step_attention.py (same shapes, CUDA graphs, one H200): 6.6 us a
call against 19.1 us for the torch form compiled (2.90x) at 136 keys, 6.8 against 19.4 at 184.

Numerics, as the torch form rounds: the scores q . k in fp32 rounded to the keys' dtype (the
einsum's output), then in fp32 times scale plus the bias; the softmax in fp32 over the keys and
the sink; the probabilities rounded to the keys' dtype before P V; P V accumulated in fp32 and
rounded once. Two passes over the keys: the running max and sum (the sink folded in first, so a
row whose keys are all masked stays finite), then each probability exp(l - max) / sum as the
torch form computes it (not an online softmax's rescaled partial products). Sums run in another
order: equal to the torch form to a bf16 ulp, not bitwise (tests/models/test_step_attention_triton.py).
The true-on-policy forward does not use it (its attention is attention_rows.py's).

Where (`runs`): the triton_attention switch (EngineConfig.triton_attention; kernel_switch.py), a
decode step (one query position: a compiled decode graph's specialisation, so the choice adds no
guard), CUDA, bf16, no gradient wanted. Forward only. Testable on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt
from .kernel_switch import forward_kernel_allowed
from .sink_attention import sink_attention

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_K = 64  # keys per tile


def runs(q: torch.Tensor, kv: torch.Tensor, enabled: bool) -> bool:
    """Whether sink attention of q [N, Sq, H, D] over kv [N, Sk, D] takes the kernel (module docstring)."""
    return (triton is not None and forward_kernel_allowed(enabled, q, kv) and q.shape[1] == 1
            and q.dtype == kv.dtype == torch.bfloat16)


def step_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float,
                   enabled: bool) -> torch.Tensor:
    """`sink_attention(q, kv, bias, sinks, scale)`, by the kernel where it `runs`."""
    if runs(q, kv, enabled):
        return sink_attention_step(q, kv, bias, sinks, scale)
    return sink_attention(q, kv, bias, sinks, scale)


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _dot, _bf16 = _gt._dot, _gt._bf16

    @triton.jit
    def _scores(q, kv_row_ptr, bias_row_ptr, k0, Sk, rd, D: tl.constexpr, BLOCK_K: tl.constexpr,
                BF16: tl.constexpr, INTERPRETED: tl.constexpr, scale):
        """One key tile of a sequence -> (its keys [BLOCK_K, BLOCK_D], the scores [BLOCK_H, BLOCK_K]
        as the torch form makes them; -inf past Sk)."""
        keys = k0 + tl.arange(0, BLOCK_K)
        k = tl.load(kv_row_ptr + keys[:, None] * D + rd[None, :], mask=(keys[:, None] < Sk) & (rd[None, :] < D),
                    other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros((q.shape[0], BLOCK_K), dtype=tl.float32), INTERPRETED)
        if BF16:  # the einsum's bf16 output
            s = _bf16(s, INTERPRETED).to(tl.float32)
        b = tl.load(bias_row_ptr + keys, mask=keys < Sk, other=float("-inf"))
        return k, s * scale + b

    @triton.jit
    def _step_kernel(q_ptr, kv_ptr, bias_ptr, sinks_ptr, out_ptr, Sk, scale,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_K: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        scale = tl.cast(scale, tl.float32)
        rh = tl.arange(0, BLOCK_H)
        rd = tl.arange(0, BLOCK_D)
        tile = (rh[:, None] < H) & (rd[None, :] < D)
        q = tl.load(q_ptr + (n * H + rh[:, None]) * D + rd[None, :], mask=tile, other=0.0)
        kv_row, bias_row = kv_ptr + n * Sk * D, bias_ptr + n * Sk
        m = tl.load(sinks_ptr + rh, mask=rh < H, other=0.0).to(tl.float32)  # the sink folded in first
        total = tl.full((BLOCK_H,), 1.0, dtype=tl.float32)
        for k0 in range(0, Sk, BLOCK_K):
            _, s = _scores(q, kv_row, bias_row, k0, Sk, rd, D, BLOCK_K, BF16, INTERPRETED, scale)
            new_m = tl.maximum(m, tl.max(s, axis=1))
            total = total * tl.exp(m - new_m) + tl.sum(tl.exp(s - new_m[:, None]), axis=1)
            m = new_m
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for k0 in range(0, Sk, BLOCK_K):
            k, s = _scores(q, kv_row, bias_row, k0, Sk, rd, D, BLOCK_K, BF16, INTERPRETED, scale)
            p = tl.exp(s - m[:, None]) / total[:, None]
            if BF16:
                p = _bf16(p, INTERPRETED)
            acc = _dot(p, k, acc, INTERPRETED)
        if BF16:
            out = _bf16(acc, INTERPRETED)
        else:
            out = acc
        tl.store(out_ptr + (n * H + rh[:, None]) * D + rd[None, :], out, mask=tile)

    @torch.library.triton_op("lockstep::sink_attention_step", mutates_args=())
    def sink_attention_step(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor,
                            scale: float) -> torch.Tensor:
        """q [N, 1, H, D], kv [N, Sk, D], bias [N, 1, Sk] (fp32 0 / -inf), sinks [H] -> [N, 1, H, D]."""
        N, _, H, D = q.shape
        q, kv, bias = q.contiguous(), kv.contiguous(), bias.float().contiguous()
        out = torch.empty_like(q)
        torch.library.wrap_triton(_step_kernel)[(N,)](
            q, kv, bias, sinks.contiguous(), out, kv.shape[1], scale, H=H, D=D,
            BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_D=max(16, triton.next_power_of_2(D)),
            BLOCK_K=BLOCK_K, BF16=q.dtype == torch.bfloat16, INTERPRETED=_gt.interpreted(), num_warps=4)
        return out

    # Shapes for torch.compile's tracing, written out: the default (the body run on fake tensors)
    # would launch the kernel itself under the interpreter, which wrap_triton leaves unwrapped.
    @sink_attention_step.register_fake
    def _(q, kv, bias, sinks, scale):
        return torch.empty_like(q)
