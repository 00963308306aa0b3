"""The compressors' slot pooling over whole rows as one Triton kernel, registered as the custom op
`lockstep::pool_slots` (issue 16, item 2: a compressed entry has the same bits whether a training
forward pooled a whole sequence or a decode step closed its block).

What: Compressor.pool_slots (read compressor.py first) for every entry in one launch instead of
64-entry row blocks: per channel, softmax over the entry's slots (C4: 2m, C128: m) in fp32, the
weights rounded to kv's dtype, weighted kv summed over the slots in fp32 and rounded once.

What is invariant, and why: one program owns one entry and BLOCK_D of its channels, with every slot
in registers; the max (exact in any order) and the two sums over slots (tl.sum's fixed tree over a
power-of-two slot count, padded slots adding exact zeros) depend on the slot count and D only,
never on how many entries share the launch.

Numerics (not the torch reference's bits; both sides run this kernel): exp on the GPU's fast exp
(a fixed function); the products kv * weight rounded to kv's dtype before the sum, as the
reference's bf16 multiply. Close to the reference to rounding (tests). Forward only; CPU tests
under TRITON_INTERPRET=1 (tests/models/test_pool_slots_triton.py).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK_D = 64  # channels per program


def available(kv: torch.Tensor) -> bool:
    """The kernel can run: Triton, CUDA (or the interpreter), bf16 or fp32 kv, no gradient wanted."""
    return _gt.forward_kernel_runs(kv)


if triton is not None:
    # by name: torch.compile's compile worker cannot resolve a module alias
    _bf16 = _gt._bf16

    @triton.jit
    def _pool_slots_kernel(kv_ptr, gate_ptr, out_ptr, SLOTS, D, stride_kr, stride_ks, stride_gr, stride_gs, stride_or,
                           SLOTS_P2: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
                           INTERPRETED: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        rs = tl.arange(0, SLOTS_P2)
        ok = (rs[:, None] < SLOTS) & (rd[None, :] < D)
        gate = tl.load(gate_ptr + r * stride_gr + rs[:, None] * stride_gs + rd[None, :], mask=ok, other=0.0)
        gate = tl.where(rs[:, None] < SLOTS, gate.to(tl.float32), float("-inf"))  # padded slots: weight 0
        kv = tl.load(kv_ptr + r * stride_kr + rs[:, None] * stride_ks + rd[None, :], mask=ok, other=0.0)
        e = tl.exp(gate - tl.max(gate, axis=0)[None, :])
        weights = e / tl.sum(e, axis=0)[None, :]
        if BF16:
            products = _bf16(kv.to(tl.float32) * _bf16(weights, INTERPRETED).to(tl.float32), INTERPRETED)
        else:
            products = kv * weights
        pooled = tl.sum(products.to(tl.float32), axis=0)
        if BF16:
            pooled = _bf16(pooled, INTERPRETED)
        tl.store(out_ptr + r * stride_or + rd, pooled, mask=rd < D)

    @torch.library.triton_op("lockstep::pool_slots", mutates_args=())
    def pool_slots(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """kv [R, slots, D], gate [R, slots, D] (position bias added; any float dtype) -> [R, D] in kv's
        dtype: softmax over the slots per channel, weighted sum."""
        R, slots, D = kv.shape
        out = kv.new_empty(R, D)
        if R == 0:
            return out
        kv, gate = kv.contiguous(), gate.contiguous()
        grid = (R, triton.cdiv(D, BLOCK_D))
        torch.library.wrap_triton(_pool_slots_kernel)[grid](
            kv, gate, out, slots, D, kv.stride(0), kv.stride(1), gate.stride(0), gate.stride(1), out.stride(0),
            SLOTS_P2=triton.next_power_of_2(slots), BLOCK_D=BLOCK_D, BF16=kv.dtype == torch.bfloat16,
            INTERPRETED=_gt.interpreted(), num_warps=4)
        return out

    @pool_slots.register_fake
    def _(kv, gate):
        return kv.new_empty(kv.shape[0], kv.shape[2])
