"""Model runner: turns the scheduled sequences into model calls and returns the logits to sample.

A step's sequences are split into forward calls:
- all decoding sequences (one new token each) in one call of [N, 1] tokens;
- prefill chunks grouped by length (a group's chunks are within 2x of each other, so padding
  at most doubles the work), one call per group;
- with `batch_invariant`, every sequence in a call of its own: a row's arithmetic then never
  depends on the other rows (on CPU torch picks matmul blockings by M, and the MoE grouped GEMM's
  per-expert M changes with the batch, so batched rows are not bitwise reproducible; see
  benchmarks/batch_invariance_cost.py for the price).
Only the last position of a sequence whose new tokens reach the end of its tokens gets logits
(the LM head never runs over prefill positions nobody samples from).

The decode path reads nothing back from the device: a call's integers travel in one pinned,
non-blocking copy (transfer.py), StepBatch carries host ints, routed experts come back by a
queued copy that the sampler's single read completes. On CUDA, decode calls replay captured
graphs (cuda_graph.py) instead of launching the forward's kernels one by one.

The model-specific part is an adapter: `DeepseekV4Adapter` here (per-slot caches, padded
[N, S] rows through `StepBatch`), `LlamaAdapter` in llama_adapter.py (flattened tokens, paged KV).
"""

from __future__ import annotations

from typing import Protocol

import torch

from lockstep.config import EngineConfig
from lockstep.engine.kv_cache import CacheManager, SlotCacheManager
from lockstep.engine.request import Sequence
from lockstep.transfer import to_device, to_host_async


class ModelAdapter(Protocol):
    routing_shape: tuple[int, int] | None  # (n_moe_layers, top_k), None for dense models

    def make_cache(self, config: EngineConfig, dtype: torch.dtype) -> CacheManager: ...

    def forward(self, seqs: list[Sequence], nums: list[int], want_logits: list[bool],
                want_routing: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (logits [M, V] fp32 of the rows with want_logits, routed experts [N, S, L, k] or None)."""


# A prefill chunk of one sequence up to this many tokens runs compiled with a padding row; longer
# ones run eagerly (DeepseekV4Adapter.forward).
PAD_ONE_ROW_MAX_TOKENS = 256


def min_compiled_chunk(model) -> int:
    """The fewest tokens a compiled prefill call computes (shorter chunks get masked padding).
    An overlapping compressor (rate m) lays a chunk of S tokens out as (S + 2m - 1) // m blocks;
    for S <= m that is 2, and a dimension of (blocks - 1) = 1 is one the compiler specialises:
    one more graph per layer kind for chunks of 2..m tokens (seen with aot_eager and inductor,
    not with dynamo alone). Padding such chunks to m + 1 tokens keeps them on the shared graph."""
    from lockstep.models.layers.compressor import Compressor

    rates = [c.m for c in model.modules() if isinstance(c, Compressor) and c.overlap]
    return max(rates, default=1) + 1


class DeepseekV4Adapter:
    def __init__(self, model):
        from lockstep.models.deepseek_v4 import Routing, StepBatch

        self.model, self._Routing, self._StepBatch = model, Routing, StepBatch
        c = model.config
        self.routing_shape = (c.num_hidden_layers, c.num_experts_per_tok)
        self.cache: SlotCacheManager | None = None
        self.graphs = None  # DecodeGraphs (cuda_graph.py) once enable_graphs() has captured them
        self.compile_prefill = True  # prefill through the graphs' compiled layers, when they exist
        self.min_compiled_chunk = min_compiled_chunk(model)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def make_cache(self, config: EngineConfig, dtype: torch.dtype) -> SlotCacheManager:
        self.cache = SlotCacheManager(self.model, config.max_model_len, config.max_num_seqs,
                                      config.cache_memory_bytes, dtype, self.device)
        return self.cache

    def enable_graphs(self, max_num_seqs: int, capture: bool = True, compile_backend="auto",
                      compile_options: dict | None = None, regions=None) -> None:
        """Decode steps replay captured CUDA graphs (capture=False: their eager stand-in, for CPU tests)."""
        from lockstep.engine.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_num_seqs, capture=capture, compile_backend=compile_backend,
                                   compile_options=compile_options, regions=regions)

    @torch.no_grad()
    def warm_up_prefill(self) -> None:
        """Compile the prefill graphs at engine start, not at the first request: one chunk of two
        padding rows (no tokens, the scratch slot) has the shapes every compiled prefill shares."""
        if self.graphs is None or self.graphs.compiled_layers is None or not self.compile_prefill:
            return
        N, S = 2, self.min_compiled_chunk
        ids, batch, _ = self._device_step([0] * (N * S), [self.cache.scratch_slot] * N, [0] * N, [0] * N, S, None)
        self.run_step(ids, batch, None, self.graphs.compiled_layers)

    def _device_step(self, ids, slots, start, num_new, S: int, max_end, extra=()):
        """A call's integers (ids N x S, per row slot, start, num_new, then `extra` lists) in one
        host->device copy that does not stall the device -> (ids [N, S], StepBatch, extra tensors)."""
        N = len(slots)
        flat = ids + slots + start + num_new + [v for e in extra for v in e]
        parts = to_device(flat, self.device).split([N * S, N, N, N] + [len(e) for e in extra])
        batch = self._StepBatch(slots=parts[1], start_pos=parts[2], num_new=parts[3], max_new=S, max_end=max_end)
        return parts[0].view(N, S), batch, parts[4:]

    def run_step(self, ids_NS: torch.Tensor, batch, routing, call_layer=None) -> torch.Tensor:
        """model.forward_step up to the final norm -> hidden [N, S, H]: the LM head runs only over
        the rows somebody samples from."""
        return self.model.hidden_step(ids_NS, batch, self.cache.cache, routing, call_layer)

    def forward(self, seqs, nums, want_logits, want_routing):
        self.cache.prepare()
        if self.graphs is not None and self.graphs.fits(nums, want_logits):
            return self.graphs.forward(seqs, want_routing)
        compiled = self.graphs.compiled_layers if self.graphs is not None and self.compile_prefill else None
        S = max(nums)
        if compiled is not None and S > 1:
            S = max(S, self.min_compiled_chunk)  # masked tokens past num_new (see min_compiled_chunk)
        rows = [i for i in range(len(seqs)) if want_logits[i]]
        # rows padded with token 0 past num_new (the model masks them as invalid)
        ids = [t for seq, n in zip(seqs, nums)
               for t in seq.tokens[seq.num_computed:seq.num_computed + n] + [0] * (S - n)]
        slots, start, num_new = [s.slot for s in seqs], [s.num_computed for s in seqs], list(nums)
        if compiled is not None and len(seqs) == 1:
            # the compiled layers specialise a batch of one row (one more compilation per layer
            # kind): a short chunk gets a padding row (no tokens, the scratch slot); a long one,
            # whose launches the GPU work hides anyway, runs eagerly rather than doubling the work
            if S > PAD_ONE_ROW_MAX_TOKENS:
                compiled = None
            else:
                ids, slots, start, num_new = (ids + [0] * S, slots + [self.cache.scratch_slot], start + [0],
                                              num_new + [0])
        # compiled: compressed attention over the cache's whole capacity, masked by position (as
        # in decode graphs): a host int bounding it would be a compile guard, one graph per value
        max_end = None if compiled is not None else max(s.num_computed + n for s, n in zip(seqs, nums))
        ids_t, batch, (rows_t, last_t) = self._device_step(ids, slots, start, num_new, S, max_end,
                                                           (rows, [nums[i] - 1 for i in rows]))
        routing = self._Routing() if want_routing else None
        hidden = self.run_step(ids_t, batch, routing, compiled)
        picked = hidden[:, 0] if S == 1 and len(rows) == len(slots) else hidden[rows_t, last_t]
        logits = self.model.compute_logits(picked)
        return logits, (routing.stacked() if routing is not None else None)


def is_decode(seq: Sequence, n: int) -> bool:
    return n == 1 and seq.num_computed > 0


def group_calls(scheduled: list[tuple[Sequence, int]], batch_invariant: bool,
                one_call: bool = False) -> list[list[tuple[Sequence, int]]]:
    """Split a step's (sequence, num_new) pairs into forward calls (see the module docstring)."""
    if batch_invariant:
        return [[x] for x in scheduled]
    if one_call:
        return [list(scheduled)] if scheduled else []
    decode = [x for x in scheduled if is_decode(*x)]
    prefill = sorted((x for x in scheduled if not is_decode(*x)), key=lambda x: -x[1])
    groups = [decode] if decode else []
    for x in prefill:
        if groups and groups[-1] is not decode and x[1] * 2 >= groups[-1][0][1]:
            groups[-1].append(x)
        else:
            groups.append([x])
    return groups


class ModelRunner:
    def __init__(self, adapter: ModelAdapter, batch_invariant: bool = False):
        self.adapter = adapter
        self.batch_invariant = batch_invariant
        # adapters whose model takes flattened tokens (no padding) batch everything in one call
        self.one_call = getattr(adapter, "flattened", False)

    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run the model over the scheduled tokens; record routed experts into the sequences.

        -> (logits [M, V] fp32, the M sequences that sample from them, in row order)."""
        all_logits, samplers, routing_in_flight = [], [], False
        groups = group_calls(scheduled, self.batch_invariant, self.one_call)
        for i, group in enumerate(groups):
            seqs = [s for s, _ in group]
            nums = [n for _, n in group]
            want = [s.num_computed + n == len(s.tokens) for s, n in group]
            want_routing = self.adapter.routing_shape is not None and any(
                s.sampling.return_routed_experts for s in seqs)
            logits, routed = self.adapter.forward(seqs, nums, want, want_routing)
            if routed is not None:
                # one queued device-to-host copy per call; complete once the sampler's read returns
                routing_in_flight |= routed.is_cuda
                routed = to_host_async(routed)
                for i, (s, n) in enumerate(group):
                    if s.sampling.return_routed_experts:
                        s.record_routing(s.num_computed, routed[i, :n])
            if i < len(groups) - 1 and logits is not None:
                # a decode call's logits are a view of its CUDA graph's output, which the next call's
                # replay overwrites (every graph shares one pool): keep a copy. Several calls in a step
                # happen with prefill groups and, for every decoding sequence, in batch-invariant mode.
                logits = logits.clone()
            all_logits.append(logits)
            samplers += [s for s, w in zip(seqs, want) if w]
        if not all_logits:
            if routing_in_flight:  # no sampler read follows in this step: wait for the copy here
                torch.cuda.current_stream().synchronize()
            return None, []
        return (all_logits[0] if len(all_logits) == 1 else torch.cat(all_logits)), samplers
