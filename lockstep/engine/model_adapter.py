"""Which adapter drives which model, and the adapter for dense Llama / Qwen3 models.

`LlamaAdapter` feeds the model's flattened incremental path (`forward_incremental`: the new
tokens of all sequences in one [T] row, no padding) over a paged KV cache whose block tables
the engine's `PagedCacheManager` owns. It asks for logits only at the rows that sample.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lockstep.config import EngineConfig
from lockstep.engine.paged_cache import PagedCacheManager
from lockstep.engine.runner import DeepseekV4Adapter


class LlamaAdapter:
    flattened = True  # the runner batches prefill and decode rows into one call
    routing_shape = None  # dense: no routed experts

    def __init__(self, model):
        from lockstep.models import llama

        self.model, self._llama = model, llama
        self.kv = None
        self.block_size = 0

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def make_cache(self, config: EngineConfig, dtype: torch.dtype) -> PagedCacheManager:
        c, bs = self.model.config, config.block_size
        per_seq = math.ceil(config.max_model_len / bs)
        block_bytes = 2 * c.num_hidden_layers * bs * c.num_key_value_heads * c.head_dim * dtype.itemsize
        num_blocks = config.max_num_seqs * per_seq  # what max_num_seqs running sequences can use at most
        if config.cache_memory_bytes is not None:
            num_blocks = min(num_blocks, config.cache_memory_bytes // block_bytes)
            if num_blocks < per_seq:
                raise ValueError(f"EngineConfig.cache_memory_bytes: {config.cache_memory_bytes} bytes hold "
                                 f"{num_blocks} KV blocks of {block_bytes} bytes; one max_model_len sequence "
                                 f"needs {per_seq}")
        self.kv = self._llama.PagedKVCache.allocate(c, num_blocks, bs, dtype=dtype, device=self.device)
        self.block_size = bs
        return PagedCacheManager(self.kv, num_blocks, bs, per_seq)

    def forward(self, seqs, nums, want_logits, want_routing):
        dev = self.device
        width = max(len(s.block_table) for s in seqs)
        tables = torch.full((len(seqs), width), -1, dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
        ends = torch.tensor(nums).cumsum(0) - 1
        rows = torch.tensor([int(ends[i]) for i, w in enumerate(want_logits) if w], dtype=torch.long)
        positions, meta = self._llama.prepare_step(tables, [s.num_computed for s in seqs], list(nums),
                                                   self.block_size, rows)
        meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(dev) for f in dataclasses.fields(meta)})
        ids = torch.tensor([t for s, n in zip(seqs, nums) for t in s.tokens[s.num_computed:s.num_computed + n]],
                           device=dev)
        logits = self.model.forward_incremental(ids, positions.to(dev), self.kv, meta)
        return logits, None


def make_adapter(model):
    """The adapter for a lockstep model: DeepSeek-V4 (per-slot caches) or Llama-family (paged)."""
    if hasattr(model, "forward_step") and hasattr(model, "new_cache"):
        return DeepseekV4Adapter(model)
    if hasattr(model, "forward_incremental"):
        return LlamaAdapter(model)
    raise TypeError(f"{type(model).__name__} has no incremental path the engine knows "
                    "(forward_step + new_cache, or forward_incremental)")
