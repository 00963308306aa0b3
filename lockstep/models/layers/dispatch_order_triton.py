"""A decode step's MoE dispatch order as one Triton kernel, registered as the custom op
`lockstep::dispatch_order_step`: moe.dispatch_order's counting form, the same integers.

What: flat [M] expert ids (a step's T x k slots) -> order [M], the slots sorted by expert stably
(a slot's place is the number of slots of lower experts plus the earlier slots of its own), and
counts [E]. A program takes BLOCK slots and counts, for each, the slots that go before it by
comparing it with every slot, BLOCK at a time (M x M comparisons: a decode step's M is a few
hundred); it stores each slot's index at its place. One more program counts the slots per expert.
Integers only, so the result is moe.dispatch_order's bit for bit.
`lockstep::decode_dispatch` places the slots the same way and writes what a decode step with the
shared expert folded reads instead (moe.Experts._with_shared): the gather's rows (order // k, then
each token once more for the shared expert), the group offsets (the shared groups included) and the
combine's slot rows (the order inverted), where torch ops took a concatenation, a cumsum and a scatter.

Why: in the compiled decode step (1b config, batch 64, one H200, `rollout_throughput.py
--step-trace`, 2026-12-04) the counting form is six inductor kernels and a scatter between the
router and the grouped GEMMs, ~11 us of device time a MoE layer (plus ~0.4 us idle before each),
~100 us of a 1,320 us step over 8 layers. The kernel (benchmarks/dispatch_order.py, 64 experts,
top 6, device time a call): 1.95 us against the compiled counting form's 7.7 at batch 8, 6.9 vs
11.9 at 64, 24.9 vs 26.3 at 256 (1,536 slots: the M^2 comparisons catch up, hence MAX_SLOTS); in
the step 7.0 us a layer.

Where (`runs`): moe.dispatch_order asked to count (decode steps, the true-on-policy experts) on
CUDA, ENABLED (the default), at most MAX_SLOTS slots (the comparisons grow as M^2). Testable on CPU with
TRITON_INTERPRET=1 (tests/models/test_dispatch_order_triton.py).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl

ENABLED = True
# past a decode step of 256 sequences at k = 6 the torch ops' sort is faster (docstring)
MAX_SLOTS = 1536
BLOCK = 64  # slots a program places, and slots compared per step of its loop
# decode_dispatch's: one H100 (2026-12-06, `dispatch_order.py --batch 64 --block 16 32 64 128`, device us
# a call in CUDA graphs) 9.47 at 16, 5.02 at 32, 5.41 at 64, 41.55 at 128; the same integers at each
DECODE_BLOCK = 32


def runs(flat: torch.Tensor) -> bool:
    """Whether dispatch_order's counting form takes the kernel for these expert ids (module docstring)."""
    return (triton is not None and ENABLED and flat.is_cuda and flat.dim() == 1
            and flat.dtype == torch.long and 0 < flat.numel() <= MAX_SLOTS)


if triton is not None:
    @triton.jit
    def _counts(flat_ptr, M, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
        """[BLOCK_E] int32: the slots per expert (experts past E count nothing)."""
        rj = tl.arange(0, BLOCK)
        re = tl.arange(0, BLOCK_E)
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for j0 in range(0, M, BLOCK):
            j = j0 + rj
            ej = tl.load(flat_ptr + j, mask=j < M, other=-1)
            counts += tl.sum((ej[None, :] == re[:, None]).to(tl.int32), axis=1)
        return counts

    @triton.jit
    def _places(flat_ptr, ri, M, BLOCK: tl.constexpr):
        """[BLOCK] int32: each slot ri's place in expert order (slots of lower experts, then the
        earlier slots of its own)."""
        rj = tl.arange(0, BLOCK)
        ei = tl.load(flat_ptr + ri, mask=ri < M, other=0)
        place = tl.zeros((BLOCK,), dtype=tl.int32)
        for j0 in range(0, M, BLOCK):
            j = j0 + rj
            ej = tl.load(flat_ptr + j, mask=j < M, other=0)
            before = (ej[None, :] < ei[:, None]) | ((ej[None, :] == ei[:, None]) & (j[None, :] < ri[:, None]))
            place += tl.sum((before & (j < M)[None, :]).to(tl.int32), axis=1)
        return place

    @triton.jit
    def _dispatch_order_kernel(flat_ptr, order_ptr, counts_ptr, M, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        if pid == tl.num_programs(0) - 1:  # the last program: slots per expert
            re = tl.arange(0, BLOCK_E)
            tl.store(counts_ptr + re, _counts(flat_ptr, M, E, BLOCK, BLOCK_E).to(tl.int64), mask=re < E)
        else:  # BLOCK slots: each one's place in expert order
            ri = pid * BLOCK + tl.arange(0, BLOCK)
            tl.store(order_ptr + _places(flat_ptr, ri, M, BLOCK), ri.to(tl.int64), mask=ri < M)

    @triton.jit
    def _decode_dispatch_kernel(flat_ptr, rows_ptr, offs_ptr, slot_rows_ptr, M, E, T, K: tl.constexpr,
                                SHARED_GROUPS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        if pid == tl.num_programs(0) - 1:  # the last program: the group offsets, the shared rows
            re = tl.arange(0, BLOCK_E)
            offs = tl.cumsum(_counts(flat_ptr, M, E, BLOCK, BLOCK_E), axis=0)
            tl.store(offs_ptr + re, offs, mask=re < E)
            if SHARED_GROUPS > 0:
                for g in tl.static_range(SHARED_GROUPS):  # grouped_gemm_triton.with_shared_groups
                    # M, T can be Python ints here (torch.compile's analysis specialises them): no .to
                    tl.store(offs_ptr + E + g, M + (g + 1) * T // SHARED_GROUPS)
                for t0 in range(0, T, BLOCK):
                    t = t0 + tl.arange(0, BLOCK)
                    tl.store(rows_ptr + M + t, t.to(tl.int64), mask=t < T)
        else:  # BLOCK slots: the row of x each one reads, and the row its output lands in
            ri = pid * BLOCK + tl.arange(0, BLOCK)
            place = _places(flat_ptr, ri, M, BLOCK)
            tl.store(rows_ptr + place, (ri // K).to(tl.int64), mask=ri < M)
            tl.store(slot_rows_ptr + ri, place.to(tl.int64), mask=ri < M)

    @torch.library.triton_op("lockstep::dispatch_order_step", mutates_args=())
    def dispatch_order_step(flat: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """flat [M] int64 expert ids in [0, n_experts) -> (order [M] int64, counts [n_experts] int64)."""
        M = flat.shape[0]
        order = torch.empty(M, dtype=torch.long, device=flat.device)
        counts = torch.empty(n_experts, dtype=torch.long, device=flat.device)
        torch.library.wrap_triton(_dispatch_order_kernel)[(triton.cdiv(M, BLOCK) + 1,)](
            flat.contiguous(), order, counts, M, n_experts, BLOCK=BLOCK,
            BLOCK_E=max(16, triton.next_power_of_2(n_experts)), num_warps=4)
        return order, counts

    # shapes for torch.compile's tracing, written out (step_attention_triton.py says why)
    @dispatch_order_step.register_fake
    def _(flat, n_experts):
        return flat.new_empty(flat.shape[0]), flat.new_empty(n_experts)

    @torch.library.triton_op("lockstep::decode_dispatch", mutates_args=())
    def decode_dispatch(flat: torch.Tensor, n_experts: int, k: int, shared_groups: int, block: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """flat [M = T k] int64 expert ids -> what the decode kernels and the combine read, from one
        kernel: rows [M (+ T)] int64, the row of x each expert-sorted row is (order // k; then the T
        tokens once more for the shared expert's groups when shared_groups > 0), offs [E (+
        shared_groups)] int32 (group_offsets of the counts, then with_shared_groups'), slot_rows [T, k]
        int64 (the sorted row holding token t's slot j: moe_combine_triton.slot_rows of the order).
        block: nonzero, a power of two overriding DECODE_BLOCK (benchmarks/dispatch_order.py --block)."""
        block = block or DECODE_BLOCK
        M = flat.shape[0]
        T = M // k
        rows = torch.empty(M + (T if shared_groups else 0), dtype=torch.long, device=flat.device)
        offs = torch.empty(n_experts + shared_groups, dtype=torch.int32, device=flat.device)
        slot_rows = torch.empty(T, k, dtype=torch.long, device=flat.device)
        torch.library.wrap_triton(_decode_dispatch_kernel)[(triton.cdiv(M, block) + 1,)](
            flat.contiguous(), rows, offs, slot_rows, M, n_experts, T, K=k, SHARED_GROUPS=shared_groups,
            BLOCK=block, BLOCK_E=max(16, triton.next_power_of_2(n_experts)), num_warps=4)
        return rows, offs, slot_rows

    @decode_dispatch.register_fake
    def _(flat, n_experts, k, shared_groups, block=0):
        M = flat.shape[0]
        T = M // k
        return (flat.new_empty(M + (T if shared_groups else 0)),
                flat.new_empty(n_experts + shared_groups, dtype=torch.int32), flat.new_empty(T, k))
