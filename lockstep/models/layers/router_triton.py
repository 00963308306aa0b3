"""A decode step's top-k router as one Triton kernel, registered as the custom op
`lockstep::route_step`: fp32 logits, scores, the top-k choice and the normalised weights.

What, per token (moe.Router has the formulas): logits = W x in fp32 (x and W converted exactly),
scores = sqrt(softplus(logits)) (or softmax / sigmoid), the k experts of highest score + bias,
returned in ascending expert order, and their weights = score / sum(selected scores) * scaling.
A program takes BLOCK_T tokens and all E experts (a [BLOCK_T, E] tile of logits), so the choice
needs no second pass: k rounds of (row max, lowest index holding it, masked out), then each chosen
expert's place among the chosen in ascending order is the count of chosen experts below it.

Why: in the compiled decode step (1b config, batch 64, one H200, 2026-12-03, `--step-trace`) the
router was four kernels per top-k layer: cuBLAS's fp32 SIMT sgemm (6.5 us) and its split-K reduce
(1.9 us), then inductor's scoring and top-k kernels (3.5 + 3.7 us), ~16 us for 8 MFLOP. Measured
so far (benchmarks/router_step.py, same H200, batch 64, CUDA graphs): the first form of this kernel,
16 tokens per program with an fp32 "ieee" tl.dot for the logits, took 48.6 us a call against the
compiled torch ops' 21.5 (eager 37.3), with the same experts chosen on every row. One token a
program with broadcast products (BLOCK_T = 1) took 22.5 us; 16 tokens a program with a "tf32x3"
tl.dot (the default now) 15.5 us against the compiled ops' 21.4 (device time, batch 64; batch 8:
15.4 vs 19.0, batch 256: 15.6 vs 23.2; 2026-12-04), the same experts chosen on every row. With the
logits as 8 split-K partials first (SPLIT, the default since) 10.9 us. In the step (rollout_throughput
--step-trace, bf16, batch 64) SPLIT, HASH and dispatch_order_triton together took the step from 328
kernels and 1,304 us of device time to 297 and 1,249 us (fp8 packed: 1,228 -> 1,174), same run.

Numerics: the logits are fp32 products summed over H (a tree within each slice of BLOCK_H), in another order
than cuBLAS's: equal to fp32 rounding, so a near-tie between two experts' biased scores may be
chosen differently than the torch path (as between any two GEMM shapes; the true-on-policy forward
does not use this kernel). Ties of equal scores go to the lower expert index. softplus is computed
as max(x, 0) + log1p(exp(-|x|)) with log1p(u) = u * log(1 + u) / ((1 + u) - 1) (exact where
1 + u rounds to 1), torch's value to a few ulp; the weights' sum adds in a tree, not k terms in order.

Where (`runs`): moe.Router at a decode step (one new token per sequence: the compiled graph's
specialisation) on CUDA, without gradients, the triton_router switch on (the default),
no forced (replayed) experts, not a hash layer, not over whole rows (whole_rows.py). Forward only.
A hash layer's router (`lockstep::hash_route_step`, `runs_hash`) under the same conditions, where
HASH (below; on) holds and the scoring is element-wise.
Testable on CPU with TRITON_INTERPRET=1 (tests/models/test_router_triton.py).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton as _gt
from . import hc_projection_triton as _hp
from .kernel_switch import forward_kernel_allowed

triton = _gt.triton
if triton is not None:
    import triton.language as tl

SCORING = {"sqrtsoftplus": 0, "softmax": 1, "sigmoid": 2}
MAX_EXPERTS = 256  # a program holds [BLOCK_T, E] logits
BLOCK_T = 16  # tokens per program: tl.dot's minimum, W read from L2 once per 16 tokens (1: once per token)
# hidden columns per step of the logits' loop: on an H200 at 16 tokens a program 14.6 us a call
# (64: 15.5, 32: 15.9, 256: 216, its tiles spilled; router_step.py --block-h, batch 64)
BLOCK_H = 128
# 0: the logits inside the routing kernel (above). S > 0: a first kernel computes them as S split-K
# partial sums (mHC's hc_projection_triton kernel: T / 16 x S programs read W in parallel, where
# the one kernel's T / 16 programs, 4 at a decode step of 64, each stream all of W), and the routing
# kernel adds the S partials first to last (E <= hc_projection_triton.MAX_J; more experts take the
# one kernel). On one H200 (router_step.py --split, 64 experts of 1024, device time a call, batch
# 64 / 256): S = 4 12.6 / 12.7 us, 8 10.9 / 11.2, 16 10.6 / 11.8, the one kernel 14.6 / 14.6.
SPLIT = 8
# the routing kernel after the partials: tokens and warps a program (no tl.dot there, so any power of two
# tokens); its k rounds of row max and lowest index are a chain of reductions, shorter on a narrower tile.
# One H100 (2026-12-05, the partials and routing kernels, batch 64, CUDA graphs): one token a program
# 7.08 us a call against 11.38 at 16 (2 tokens 7.10; one warp within 0.1 us but not bitwise the same
# weights: another sum layout); the same experts and weight bits as 16 tokens at batch 8, 64 and 256
PARTIALS_BLOCK_T = 1
PARTIALS_WARPS = 4
# A hash layer's router (its experts are a table's row for the token id): one program a token
# computes only its k experts' logits, k x H products, where the torch ops compute all E (on one
# H200, 1b config, batch 64: an fp32 sgemm 6.4 us, its split-K reduce 1.9 and two inductor kernels
# 3.4 + 5.0, ~17 us a layer). router_step.py --hash: 5.1 us a call against the compiled ops' 14.9
# (batch 64; 5.4 vs 15.8 at 256).
HASH = True
HASH_BLOCK_H = 256  # hidden columns per step of a program's loop (k rows of W, one of x)


def _routing_outputs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (experts [T, k] int64, weights [T, k] fp32) on x's device: the ops' results, and
    their shapes for torch.compile's tracing."""
    return x.new_empty(x.shape[0], k, dtype=torch.long), x.new_empty(x.shape[0], k, dtype=torch.float32)


def runs_hash(x: torch.Tensor, weight: torch.Tensor, scoring: str, enabled: bool) -> bool:
    """Whether a hash layer's x [T, H] routes through hash_route_step: `runs`, HASH on, and a scoring
    applied to each logit alone (softmax normalises over every expert's)."""
    return HASH and scoring != "softmax" and runs(x, weight, enabled)


def runs(x: torch.Tensor, weight: torch.Tensor, enabled: bool) -> bool:
    """Whether x [T, H] routes through the kernel: Triton present, the switch on, CUDA, no gradient
    wanted, float inputs, E within MAX_EXPERTS (the caller checks the rest: module docstring)."""
    return (triton is not None and forward_kernel_allowed(enabled, x, weight) and x.dim() == 2
            and weight.shape[0] <= MAX_EXPERTS and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


if triton is not None:
    _dot = _gt._dot  # by name: a compile worker rebuilds the kernel from the functions it names

    @triton.jit
    def _logits(x_ptr, w_ptr, rt, re, t_ok, e_ok, H, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_H: tl.constexpr, INTERPRETED: tl.constexpr):
        """[BLOCK_T, BLOCK_E] fp32 logits of rows rt against experts re (x and W contiguous). One token a
        program: products broadcast and summed over each [BLOCK_H] slice. 16 or more: tl.dot in
        "tf32x3" (three tf32 products per fp32 one, hc_projection_triton.py: 1.9e-6 from fp32 there),
        so the programs read W once per 16 tokens (fp32 "ieee" tl.dot, the first form, took 48 us a
        call at batch 64 on an H200, 2.3x the torch ops it replaces)."""
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        rh = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + rh
            h_ok = h < H
            a = tl.load(x_ptr + rt[:, None] * H + h[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
            b = tl.load(w_ptr + re[:, None] * H + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
            a, b = a.to(tl.float32), b.to(tl.float32)
            if BLOCK_T < 16:
                acc += tl.sum(a[:, None, :] * b[None, :, :], axis=2)
            elif INTERPRETED:  # products summed in index order (grouped_gemm_triton._dot)
                acc = _dot(a, tl.trans(b), acc, True)
            else:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="tf32x3")
        return acc

    @triton.jit
    def _log1p(u):
        """log(1 + u) for u in [0, 1], to a few ulp where log(1 + u) alone loses u's low bits."""
        v = 1.0 + u
        exact = v == 1.0
        return tl.where(exact, u, tl.log(v) * (u / tl.where(exact, 1.0, v - 1.0)))

    @triton.jit
    def _scores(logits, e_ok, SCORING: tl.constexpr):
        if SCORING == 0:  # sqrt(softplus(x)), softplus = max(x, 0) + log1p(exp(-|x|)); torch's threshold 20
            soft = tl.maximum(logits, 0.0) + _log1p(tl.exp(-tl.abs(logits)))
            s = tl.sqrt_rn(tl.where(logits > 20.0, logits, soft))
        elif SCORING == 1:
            z = tl.where(e_ok[None, :], logits, float("-inf"))
            e = tl.exp(z - tl.max(z, axis=1)[:, None])
            s = e / tl.sum(e, axis=1)[:, None]
        else:
            s = tl.sigmoid(logits)
        return s

    @triton.jit
    def _choose(scores, bias_ptr, experts_ptr, weights_ptr, rt, re, t_ok, e_ok, scaling,
                K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        """The k experts of highest score + bias per row, ascending, and their normalised weights."""
        biased = scores + tl.load(bias_ptr + re, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        # NaN as -inf: a broken row still gets k distinct experts below E (the dispatch indexes with them)
        biased = tl.where(e_ok[None, :] & (biased == biased), biased, float("-inf"))
        chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for _ in tl.static_range(K):  # the highest remaining, the lowest index among equals
            best = tl.max(biased, axis=1)
            free = (biased == best[:, None]) & ~chosen & e_ok[None, :]
            pick = tl.min(tl.where(free, re[None, :], BLOCK_E), axis=1)
            hit = re[None, :] == pick[:, None]
            chosen = chosen | hit
            biased = tl.where(hit, float("-inf"), biased)
        kept = tl.where(chosen, scores, 0.0)
        total = tl.sum(kept, axis=1)
        scaling = tl.cast(scaling, tl.float32)
        weights = kept / (total + 1e-20)[:, None] * scaling
        place = tl.cumsum(chosen.to(tl.int32), axis=1) - 1  # the ascending order of the chosen
        out = rt[:, None].to(tl.int64) * K + place
        keep = chosen & t_ok[:, None]
        tl.store(experts_ptr + out, (re[None, :] + tl.zeros_like(place)).to(tl.int64), mask=keep)
        tl.store(weights_ptr + out, weights, mask=keep)

    @triton.jit
    def _route_kernel(x_ptr, w_ptr, bias_ptr, experts_ptr, weights_ptr, T, H, E, scaling,
                      K: tl.constexpr, SCORING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_H: tl.constexpr, INTERPRETED: tl.constexpr):
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        re = tl.arange(0, BLOCK_E)
        t_ok, e_ok = rt < T, re < E
        scores = _scores(_logits(x_ptr, w_ptr, rt, re, t_ok, e_ok, H, BLOCK_T, BLOCK_E, BLOCK_H, INTERPRETED),
                         e_ok, SCORING)
        _choose(scores, bias_ptr, experts_ptr, weights_ptr, rt, re, t_ok, e_ok, scaling, K, BLOCK_T, BLOCK_E)

    @triton.jit
    def _route_partials_kernel(p_ptr, bias_ptr, experts_ptr, weights_ptr, T, E, S, stride_ps, stride_pt, scaling,
                               K: tl.constexpr, SCORING: tl.constexpr, BLOCK_T: tl.constexpr,
                               BLOCK_E: tl.constexpr):
        """As _route_kernel, from logits given as S split-K partial sums p [S, T, >= E] (added in order)."""
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        re = tl.arange(0, BLOCK_E)
        t_ok, e_ok = rt < T, re < E
        rows = p_ptr + rt[:, None].to(tl.int64) * stride_pt + re[None, :]
        logits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for s in range(S):
            logits += tl.load(rows + s * stride_ps, mask=t_ok[:, None] & e_ok[None, :], other=0.0)
        _choose(_scores(logits, e_ok, SCORING), bias_ptr, experts_ptr, weights_ptr, rt, re, t_ok, e_ok, scaling,
                K, BLOCK_T, BLOCK_E)

    @torch.library.triton_op("lockstep::route_step", mutates_args=())
    def route_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, scoring: str,
                   scaling: float, block_t: int = 0, block_h: int = 0, split: int = -1, warps: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], weight [E, H], bias [E] -> (experts [T, k] int64 ascending, weights [T, k] fp32).
        block_t, block_h: nonzero, override BLOCK_T (PARTIALS_BLOCK_T after the partials) and BLOCK_H
        (benchmarks/router_step.py); from 16 tokens a program the logits take tl.dot (`_logits`). split:
        >= 0 overrides SPLIT. warps: nonzero, the routing kernel's after the partials (PARTIALS_WARPS)."""
        split = SPLIT if split < 0 else split
        T, H = x.shape
        E = weight.shape[0]
        experts, weights = _routing_outputs(x, k)
        if T and split and E <= _hp.MAX_J:  # the partials kernel holds at most MAX_J columns
            partials = _hp.launch_partials(x, weight, split)
            block_t = block_t or PARTIALS_BLOCK_T
            torch.library.wrap_triton(_route_partials_kernel)[(triton.cdiv(T, block_t),)](
                partials, bias.contiguous(), experts, weights, T, E, split, partials.stride(0), partials.stride(1),
                scaling, K=k, SCORING=SCORING[scoring], BLOCK_T=block_t, BLOCK_E=max(16, triton.next_power_of_2(E)),
                num_warps=warps or PARTIALS_WARPS)
        elif T:
            block_t, block_h = block_t or BLOCK_T, block_h or BLOCK_H
            torch.library.wrap_triton(_route_kernel)[(triton.cdiv(T, block_t),)](
                x.contiguous(), weight.contiguous(), bias.contiguous(), experts, weights, T, H, E, scaling,
                K=k, SCORING=SCORING[scoring], BLOCK_T=block_t, BLOCK_E=max(16, triton.next_power_of_2(E)),
                BLOCK_H=block_h, INTERPRETED=_gt.interpreted(), num_warps=4)
        return experts, weights

    # shapes for torch.compile's tracing, written out (step_attention_triton.py says why)
    @route_step.register_fake
    def _(x, weight, bias, k, scoring, scaling, block_t=0, block_h=0, split=-1, warps=0):
        return _routing_outputs(x, k)

    @triton.jit
    def _hash_route_kernel(x_ptr, w_ptr, table_ptr, ids_ptr, experts_ptr, weights_ptr, H, scaling,
                           K: tl.constexpr, SCORING: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
        """One token a program: its k experts from the hash table's row of its token id, their k
        logits (the only ones an element-wise scoring needs), scores and normalised weights, stored
        in ascending expert order (a stable rank: equal ids keep their table order)."""
        t = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        k_ok = rk < K
        ids = tl.load(table_ptr + tl.load(ids_ptr + t).to(tl.int64) * K + rk, mask=k_ok, other=0)
        rh = tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + rh
            h_ok = h < H
            xh = tl.load(x_ptr + t.to(tl.int64) * H + h, mask=h_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + ids[:, None].to(tl.int64) * H + h[None, :], mask=k_ok[:, None] & h_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * xh[None, :], axis=1)
        scores = tl.where(k_ok, _scores(acc, k_ok, SCORING), 0.0)  # element-wise scorings only
        weights = scores / (tl.sum(scores, axis=0) + 1e-20) * tl.cast(scaling, tl.float32)
        below = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (rk[None, :] < rk[:, None]))
        place = tl.sum((below & k_ok[None, :]).to(tl.int32), axis=1)  # [BLOCK_K]: earlier in ascending order
        out = t.to(tl.int64) * K + place
        tl.store(experts_ptr + out, ids.to(tl.int64), mask=k_ok)
        tl.store(weights_ptr + out, weights, mask=k_ok)

    @torch.library.triton_op("lockstep::hash_route_step", mutates_args=())
    def hash_route_step(x: torch.Tensor, weight: torch.Tensor, tid2eid: torch.Tensor, token_ids: torch.Tensor,
                        scoring: str, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], weight [E, H], tid2eid [V, k], token_ids [T] -> (experts [T, k] int64 ascending,
        weights [T, k] fp32): a hash layer's decode routing (element-wise scorings only: `runs_hash`)."""
        T, H = x.shape
        k = tid2eid.shape[1]
        experts, weights = _routing_outputs(x, k)
        if T:
            torch.library.wrap_triton(_hash_route_kernel)[(T,)](
                x.contiguous(), weight.contiguous(), tid2eid.contiguous(), token_ids.reshape(-1).contiguous(),
                experts, weights, H, scaling, K=k, SCORING=SCORING[scoring],
                BLOCK_K=triton.next_power_of_2(k), BLOCK_H=HASH_BLOCK_H, num_warps=4)
        return experts, weights

    @hash_route_step.register_fake
    def _(x, weight, tid2eid, token_ids, scoring, scaling):
        return _routing_outputs(x, tid2eid.shape[1])
