"""DeepSeek-V4 mixture of experts: routers (top-k or hash), routed experts, shared expert.

Router: logits = W x in fp32 (both operands cast up, as DeepSeek's inference code computes
them: bf16 logits round near-ties differently in the engine's and the trainer's GEMM shapes,
and a flipped top-k choice changes the token's logprob); score = sqrt(softplus(logits))
(`sqrtsoftplus`; `softmax` and `sigmoid` also accepted); experts = top-k of score + bias (the bias only selects), or tid2eid[token] for
hash layers; weights = score / sum(selected scores) * routed_scaling_factor.
Experts are SwiGLU with a clamp: gate <= limit, -limit <= up <= limit (the shared expert
too). Each token's k expert outputs are added in ascending expert order, one at a time, so
the sum does not depend on which other tokens share the batch. At an engine's decode step the
shared expert runs inside the routed experts' kernels as groups of their own (`Experts.folds_shared`).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch_order_triton, grouped_gemm_triton, moe_combine_triton, router_triton, swiglu_triton
from .fused_linear import project
from .grouped_gemm import group_offsets, grouped_mm, triton_experts
from .hyper_connection import hc_combine
from .kernel_switch import Switched
from .row_blocks import in_rows_forward
from .whole_rows import (apply_linear, in_whole_rows, linear, row_local, sigmoid_any_size, softmax_in_order,
                         sum_in_order)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = logits.float()
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    whole = in_whole_rows()  # the forms whose bits cannot depend on the row count (whole_rows.py)
    if scoring_func == "softmax":
        return softmax_in_order(logits, -1) if whole else logits.softmax(dim=-1)
    return sigmoid_any_size(logits) if whole else logits.sigmoid()


class Router(Switched, nn.Module):
    """Top-k router (`is_hash=False`, with selection bias) or hash router (tid2eid table)."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, vocab_size: int, is_hash: bool,
                 scoring_func: str, routed_scaling_factor: float):
        super().__init__()
        self.top_k, self.is_hash = top_k, is_hash
        self.scoring_func, self.routed_scaling_factor = scoring_func, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size))
        if is_hash:
            # a buffer, not a parameter: weight sync must still carry it (Miles PR 2706)
            self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None,
                forced: torch.Tensor | None = None, decode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (experts [T, k] ascending, weights [T, k] fp32). `decode`: the rows are a
        decode step's, which a router computes in one kernel (router_triton.py)."""
        if decode and forced is None and not in_whole_rows():
            on = self.kernels.on("triton_router")
            if self.is_hash and router_triton.runs_hash(x, self.weight, self.scoring_func, on):
                return router_triton.hash_route_step(x, self.weight, self.tid2eid, token_ids, self.scoring_func,
                                                     self.routed_scaling_factor)
            if not self.is_hash and router_triton.runs(x, self.weight, on):
                return router_triton.route_step(x, self.weight, self.e_score_correction_bias, self.top_k,
                                                self.scoring_func, self.routed_scaling_factor)
        return self.route(self.logits(x), token_ids, forced)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> logits [T, E] fp32. Never part of a fused bf16 GEMM (MoE.input_linears)."""
        return linear(x.float(), self.weight.float())

    def route(self, logits: torch.Tensor, token_ids: torch.Tensor | None,
              forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same from the router's logits [T, E] (its weight times x)."""
        scores = router_scores(logits, self.scoring_func)
        if forced is not None:
            experts = forced.long()
        elif self.is_hash:
            experts = self.tid2eid[token_ids.reshape(-1)].long()
        else:
            biased = scores + self.e_score_correction_bias.float()
            experts = _top_k(biased, self.top_k)
        experts = experts.sort(dim=-1).values
        weights = scores.gather(1, experts)
        total = sum_in_order(weights, -1).unsqueeze(-1) if in_whole_rows() else weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20)
        return experts, weights * self.routed_scaling_factor


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest-scoring experts per row (any order). Over whole rows a stable sort: its result is
    one function of the row (ties to the lower index), where topk's algorithm, and so the winner of
    a tie, can change with the row count (whole_rows.py)."""
    if in_whole_rows():
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.topk(scores, k, dim=-1, sorted=False).indices


# above this many one-hot entries (slots x experts) a caller that lets the size decide sorts
COUNTING_MAX_ENTRIES = 2**20


def dispatch_order(flat: torch.Tensor, n_experts: int,
                   counting: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [M] expert ids -> (order [M]: the slots sorted by expert, stably; counts [E]).

    Small batches (a decode step) count instead of sorting: a slot's place is the number of slots
    of lower experts plus the earlier slots of its own, from one [E, M] one-hot cumulative sum.
    On GPUs the stable argsort was a 27 us single-block radix sort per layer; the counting is a
    few fused element-wise kernels. Both give the same permutation. Counts are never read on the
    host (bincount would read the max id back to size its output: a device sync).
    counting: True counts, False sorts, None decides by size. The layers pass the step's kind
    (decode counts): in a compiled prefill graph a size test is a guard, and the first prefill
    past it compiled every layer kind again (4 graphs, 100 s at the 1b config's first prefill, H200).
    Asked to count on CUDA, one Triton kernel may do it (dispatch_order_triton.py; up to MAX_SLOTS slots)."""
    if counting is None:
        counting = flat.numel() * n_experts <= COUNTING_MAX_ENTRIES
    elif counting and dispatch_order_triton.runs(flat):  # the same integers in one kernel
        return dispatch_order_triton.dispatch_order_step(flat, n_experts)
    if not counting:
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(n_experts, dtype=flat.dtype, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        return order, counts
    return counting_order(flat, n_experts)


def counting_order(flat: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dispatch_order's counting form in torch ops."""
    # [E, M], the scan along the last dim: a cumulative sum over dim 0 of [M, E] was CUDA's
    # outer-dim scan, 63 us per layer in an eager decode step (H200), ~7% of the step
    one_hot = (torch.arange(n_experts, device=flat.device).unsqueeze(1) == flat).long()
    counts = one_hot.sum(1)
    rank = (one_hot.cumsum(1) * one_hot).sum(0) - 1  # earlier slots with the same expert
    dest = (counts.cumsum(0) - counts)[flat] + rank
    order = torch.empty_like(flat).scatter_(0, dest, torch.arange(flat.numel(), device=flat.device))
    return order, counts


_WINDOW: ContextVar[range | None] = ContextVar("expert_window", default=None)


@contextmanager
def expert_window(rows: range | None):
    """Experts built inside hold experts `rows` only (None: all), in storage of that size from the
    start: an expert-parallel rank's block of a model whose experts do not fit one host
    (checkpoint.load_pretrained reads just those rows). Such experts compute nothing until sharded."""
    token = _WINDOW.set(rows)
    try:
        yield
    finally:
        _WINDOW.reset(token)


def _held_rows(n_experts: int) -> range:
    rows = _WINDOW.get()
    if rows is None:
        return range(n_experts)
    if rows.step != 1 or not rows or rows.start < 0 or rows.stop > n_experts:
        raise ValueError(f"expert window {rows} is not a non-empty block of the {n_experts} routed experts "
                         "(n_routed_experts)")
    return rows


def _combine_sorted(ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ys [T k, H] in expert order (row i is token-slot order[i]) -> `_combine` of them in token order."""
    T, k = weights.shape
    return _combine(torch.empty_like(ys).index_copy(0, order, ys).view(T, k, -1), weights, dtype)


def _combine(per_slot: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """per_slot [T, k, H] (slot j: the j-th chosen expert's output) -> [T, H]: each token's k outputs
    added one at a time in ascending expert order, so the sum does not depend on the batch."""
    out = torch.zeros(per_slot.shape[0], per_slot.shape[2], dtype=dtype, device=per_slot.device)
    for j in range(per_slot.shape[1]):
        out = out + (per_slot[:, j].float() * weights[:, j:j + 1]).to(dtype)
    return out


def _row_invariant_kernels(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """The Triton grouped kernels can serve the true-on-policy experts: on CUDA, bf16, shapes the
    kernels take (the CPU tests run them under the interpreter by patching this)."""
    return (x.is_cuda and grouped_gemm_triton.available(x, gate_up) and down.dtype == torch.bfloat16
            and gate_up.shape[1] == 2 * down.shape[2])


class _KernelExperts(torch.autograd.Function):
    """Rows sorted by expert through the Triton grouped kernels (SwiGLU fused); the backward
    recomputes the default path (grouped_mm) and differentiates it (the kernels have none). The
    trainer and pipeline stages run the true-on-policy forward without autograd (their gradient
    comes from the default forward), so this backward serves a caller who asks for one there."""

    @staticmethod
    def forward(ctx, xs, gate_up, down, counts, limit: float):
        ctx.save_for_backward(xs, gate_up, down, counts)
        ctx.limit = limit
        offs = group_offsets(counts)
        return grouped_gemm_triton.grouped_mm(grouped_gemm_triton.grouped_swiglu(xs, gate_up, offs, limit), down, offs)

    @staticmethod
    def backward(ctx, grad):
        xs, gate_up, down, counts = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((xs, gate_up, down), ctx.needs_input_grad)]
        with torch.enable_grad():
            gate, up = grouped_mm(inputs[0], inputs[1], counts).chunk(2, dim=-1)
            ys = grouped_mm(swiglu_clamped(gate, up, ctx.limit), inputs[2], counts)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(ys, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None)


class Experts(Switched, nn.Module):
    """Routed experts stored stacked: gate_up_proj [E, 2F, H] (gate rows, then up), down_proj [E, H, F];
    built inside `expert_window`, only experts `rows` ([E', ...]) of the n_experts the router picks."""

    def __init__(self, n_experts: int, hidden_size: int, intermediate_size: int, swiglu_limit: float):
        super().__init__()
        self.n_experts, self.limit, self.rows = n_experts, swiglu_limit, _held_rows(n_experts)
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.rows), 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(len(self.rows), hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                decode: bool = False, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                hc: tuple | None = None) -> torch.Tensor:
        """decode: the rows are a decode step's (one new token per sequence), see `mlp`. shared: the
        shared expert's weights where `folds_shared` took them; the result then includes its output.
        hc: the block's mHC (streams [T, n, H], post, comb) where `fuses_hc` said so: the result is
        then the streams after hyper_connection.hc_combine of the output."""
        if in_rows_forward():
            return self.rows_mlp(x, experts, weights)
        if shared is not None:
            return self._with_shared(x, experts, weights, shared, hc)
        k = experts.shape[1]
        order, counts = dispatch_order(experts.flatten(), self.n_experts, counting=decode)
        kernels = self.kernels.on("triton_combine")  # the trainer's, when switched on
        dispatched = moe_combine_triton.applies(x, x, kernels)  # the kernel where x's gradient is wanted
        xs = moe_combine_triton.dispatch(x, order, k) if dispatched else x[order // k]
        ys = self.sorted_mlp(xs, counts, decode)
        if ys.dtype == x.dtype and moe_combine_triton.applies(ys, weights, kernels):
            return moe_combine_triton.combine(ys, order, weights)
        return _combine_sorted(ys, order, weights, x.dtype)

    def folds_shared(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        """Whether a decode step's shared expert (gate_up [2F, H]: gate rows then up, down [H, F]) can
        run inside these experts' decode kernels, as groups of its own (grouped_gemm_triton.py): the
        kernels take x, and its weights are laid out as one routed expert's. Saves its two GEMMs and
        its SwiGLU, three launches a layer. Not where the rows leave the process (expert parallel)."""
        mine = self.expert_weights()
        return (isinstance(gate_up, torch.Tensor) and triton_experts(x, *mine, self.kernels.on("triton_moe"))
                and all(grouped_gemm_triton.laid_out_as_one(w, m) for w, m in zip((gate_up, down), mine)))

    def fuses_hc(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, streams: torch.Tensor) -> bool:
        """Whether a decode step's combine kernel (with the shared expert folded) can also do the block's
        mHC combine into `streams` (moe_combine_triton.FUSED_HC): one kernel less a layer."""
        return (moe_combine_triton.FUSED_HC and streams.dtype == torch.bfloat16 == x.dtype
                and self._fused_dispatch(experts.flatten(), x, weights))

    def _fused_dispatch(self, flat: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> bool:
        return dispatch_order_triton.runs(flat) and moe_combine_triton.step_applies(x, weights)

    def _with_shared(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     shared: tuple[torch.Tensor, torch.Tensor], hc: tuple | None = None) -> torch.Tensor:
        """A decode step's kernels over the routed rows and then every token once more for the shared
        expert; combined as `forward` combines, then the shared output added, as MoE adds it. On
        CUDA the rows, offsets and combine's rows come from one kernel and the combine is one more
        (the same bits; six inductor kernels, an index_copy and a cumsum otherwise)."""
        T, k = weights.shape
        flat = experts.flatten()
        if self._fused_dispatch(flat, x, weights):
            rows, offs, slot_rows = dispatch_order_triton.decode_dispatch(
                flat, self.n_experts, k, grouped_gemm_triton.SHARED_GROUPS)
            return moe_combine_triton.combine_step(self.decode_mlp(x, offs, shared, rows), slot_rows, weights, True,
                                                   *(hc or ()))
        order, counts = dispatch_order(flat, self.n_experts, counting=True)
        rows = torch.cat([order // k, torch.arange(T, device=x.device)])
        offs = grouped_gemm_triton.with_shared_groups(group_offsets(counts), T)
        ys = self.decode_mlp(x, offs, shared, rows)
        return _combine_sorted(ys[:T * k], order, weights, x.dtype) + ys[T * k:]

    def rows_mlp(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The true-on-policy experts (deepseek_v4_rows.py): a row's output must not depend on which
        experts its neighbours picked, and a GEMM over the rows grouped by expert has group sizes that
        do. So: the Triton grouped kernels where they run (bf16 on CUDA), whose launch config depends
        on N and K only (grouped_gemm_triton.py), with the default path's gradient; elsewhere every
        held expert computes every row ([E, rows, ...] GEMMs: E / k times the FLOPs)."""
        if len(self.rows) != self.n_experts:
            raise RuntimeError(f"the true-on-policy forward computes all {self.n_experts} routed experts on one "
                               f"device; these hold {self.rows} only (expert parallel is not supported there)")
        gate_up, down = self.expert_weights()
        T, k = experts.shape
        if _row_invariant_kernels(x, gate_up, down):
            order, counts = dispatch_order(experts.flatten(), self.n_experts, counting=True)
            ys = _KernelExperts.apply(x[order // k], gate_up, down, counts, self.limit)
            return _combine_sorted(ys, order, weights, x.dtype)
        E, F2, H = gate_up.shape
        gate, up = F.linear(x, gate_up.reshape(E * F2, H)).view(-1, E, F2).transpose(0, 1).chunk(2, dim=-1)
        ys = torch.bmm(swiglu_clamped(gate, up, self.limit), down.transpose(1, 2))  # [E, T, H]
        return _combine(ys[experts, torch.arange(T, device=x.device).unsqueeze(1)], weights, x.dtype)

    def sorted_mlp(self, xs: torch.Tensor, counts: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """Rows sorted by expert, counts [E] over all E experts -> each row's expert output, rows in
        the same order. The seam expert parallelism replaces (lockstep/dist/expert_parallel.py sends
        the rows to the ranks that hold their experts and brings the outputs back), so the dispatch
        order and the combine above stay this module's on every layout."""
        if len(self.rows) != self.n_experts:  # counts index all experts: the weights would be misread
            raise RuntimeError(f"these experts hold {self.rows} of {self.n_experts} only (an expert window): "
                               "shard them over their expert-parallel ranks before running the model")
        return self.mlp(xs, counts, decode)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E', 2F, H], down [E', H, F]) as plain tensors, for the E' experts `mlp` computes:
        all of them here; an expert-parallel subclass returns its rank's slice."""
        return self.gate_up_proj, self.down_proj

    def mlp(self, xs: torch.Tensor, counts: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """Rows sorted by expert, counts [E] -> each row through its expert's clamped SwiGLU MLP.
        A decode step's few rows per expert take the Triton kernels (SwiGLU fused, one kernel per
        GEMM); prefill's many take CUTLASS's large tiles. Deciding by the step's kind, not by the
        row count, adds no compile guard: a compiled graph is already specialised to S = 1."""
        gate_up, down = self.expert_weights()
        if decode and triton_experts(xs, gate_up, down, self.kernels.on("triton_moe")):
            return self.decode_mlp(xs, group_offsets(counts))
        h = grouped_mm(xs, gate_up, counts)
        if swiglu_triton.applies(h):  # the trainer's: one kernel each way (swiglu_triton.py)
            return grouped_mm(swiglu_triton.swiglu_clamped(h, self.limit), down, counts)
        return grouped_mm(swiglu_clamped(*h.chunk(2, dim=-1), self.limit), down, counts)

    def decode_mlp(self, x: torch.Tensor, offs: torch.Tensor, shared=None, rows=None) -> torch.Tensor:
        """The decode kernels (SwiGLU fused into the first) over the rows x[rows] (x itself without
        `rows`) sorted by expert, offs int32 cumulative counts; `shared` as `folds_shared` took it, its
        groups at the end of offs. The first kernel reads the rows where they are (no gathered copy)."""
        gate_up, down = self.expert_weights()
        shared_gate_up, shared_down = shared or (None, None)
        act = grouped_gemm_triton.grouped_swiglu(x, gate_up, offs, self.limit, shared=shared_gate_up, rows=rows)
        return grouped_gemm_triton.grouped_mm(act, down, offs, shared=shared_down)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float):
        super().__init__()
        self.limit = swiglu_limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_gate_up(self.gate_proj(x), self.up_proj(x))

    def from_gate_up(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return apply_linear(self.down_proj, swiglu_clamped(gate, up, self.limit))


def _combined(out: torch.Tensor, hc: tuple | None) -> torch.Tensor:
    """The block's output, or given its mHC (streams, post, comb) the streams after hc_combine of it."""
    return out if hc is None else hc_combine(hc[0], out, hc[1], hc[2])


class MoE(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        c = config
        self.gate = Router(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.vocab_size,
                           c.mlp_layer_types[layer_idx] == "hash_moe", c.scoring_func, c.routed_scaling_factor)
        self.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.swiglu_limit)
        self.shared_experts = (SharedExpert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit)
                               if c.n_shared_experts else None)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None, forced: torch.Tensor | None = None,
                hc: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> (output [..., H], experts chosen [..., k]). In the true-on-policy forward
        (deepseek_v4_rows.py) the rows go through in row blocks, the experts as Experts.rows_mlp says.
        hc: the block's mHC (streams [..., n, H], post, comb): the first result is then the streams
        after hyper_connection.hc_combine of the output (at a decode step one kernel may do both)."""
        if in_rows_forward():
            flat = x.reshape(-1, x.shape[-1])
            ids = None if token_ids is None else token_ids.reshape(-1)
            fixed = None if forced is None else forced.reshape(-1, forced.shape[-1])
            # whole rows (whole_rows.py) where the routed experts take the row-invariant kernels
            whole = in_whole_rows() and _row_invariant_kernels(flat, *self.experts.expert_weights())
            out, experts = row_local(whole, MoE._route_and_compute, flat, ids, fixed, owner=self)
            return _combined(out.view(x.shape), hc), experts.view(*x.shape[:-1], -1)
        return self._route_and_compute(x, token_ids, forced, hc)

    def _route_and_compute(self, x: torch.Tensor, token_ids: torch.Tensor | None, forced: torch.Tensor | None = None,
                           hc: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        forced_flat = forced.reshape(-1, forced.shape[-1]) if forced is not None else None
        decode = x.dim() == 3 and x.shape[1] == 1
        experts, weights = self.gate(flat, token_ids, forced_flat, decode=decode)
        chosen = experts.view(*shape[:-1], -1)
        shared = self._foldable_shared(flat) if decode else None
        if shared is not None and hc is not None and self.experts.fuses_hc(flat, experts, weights, hc[0]):
            streams, post, comb = hc  # the combine kernel does the mHC combine too
            n = streams.shape[-2]
            flat_hc = (streams.reshape(-1, n, shape[-1]), post.reshape(-1, n), comb.reshape(-1, n, n))
            combined = self.experts(flat, experts, weights, decode=decode, shared=shared, hc=flat_hc)
            return combined.view(streams.shape), chosen
        out = self.experts(flat, experts, weights, decode=decode, shared=shared)
        if self.shared_experts is not None and shared is None:
            out = out + self.shared_experts.from_gate_up(*project(self, self.input_linears(), flat))
        return _combined(out.view(shape), hc), chosen

    def _foldable_shared(self, x: torch.Tensor) -> tuple | None:
        """The shared expert's (gate_up, down) where the routed experts' decode kernels can compute it
        (Experts.folds_shared): its gate and up fused into one matrix (the engine's, fused_linear.py),
        bf16, or packed fp8 as (bytes, block scales) pairs."""
        if self.shared_experts is None:
            return None
        down = self.shared_experts.down_proj
        if getattr(self, "fused_weight", None) is not None:
            weights = (self.fused_weight, down.weight)
        elif getattr(self, "fused_fp8_weight", None) is not None and hasattr(down, "weight_scale"):
            weights = ((self.fused_fp8_weight, self.fused_fp8_scale), (down.weight, down.weight_scale))
        else:
            return None
        return weights if self.experts.folds_shared(x, *weights) else None

    def input_linears(self) -> list[nn.Module]:
        """The shared expert's gate and up: they read the same x (fused_linear.py). The router
        reads it too but computes in fp32 (Router.logits), so it stays out of the bf16 GEMM."""
        shared = self.shared_experts
        return [shared.gate_proj, shared.up_proj] if shared is not None else []
