"""Cache memory managers: who holds which part of the rollout cache.

The scheduler only talks to the `CacheManager` interface, in units of blocks:

    can_allocate(seq, num_tokens)   could seq hold positions [0, num_tokens) after allocating?
    allocate(seq, num_tokens)       make it so (never fails after can_allocate said yes)
    fork_cost()                     blocks one sibling needs to start from a copy of its leader
    fork(src, dsts)                 give each of dsts a copy of src's computed state (n > 1 sampling)
    free(seq)                       give everything back (finish, abort, preemption)

Two implementations:
- `SlotCacheManager` (DeepSeek-V4): a sequence's cache is a fixed-size slot (the sliding-window
  ring plus the compressed entries of max_model_len tokens), so one block = one slot, and the
  number of slots is cache_memory_bytes // bytes_per_slot. A running sequence never grows.
- `PagedCacheManager` (dense models, `paged_cache.py`): vLLM-style block tables.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from lockstep.engine.request import Sequence
from lockstep.transfer import to_device


class CacheManager(Protocol):
    num_blocks: int
    nbytes: int  # the cache's memory
    full_sequences: int  # sequences of max_model_len tokens the cache holds at once

    def num_free_blocks(self) -> int: ...
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool: ...
    def allocate(self, seq: Sequence, num_tokens: int) -> None: ...
    def fork_cost(self) -> int: ...
    def fork(self, src: Sequence, dsts: list[Sequence]) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def reset_all(self) -> None: ...


class OutOfCacheMemory(RuntimeError):
    pass


def copy_slot(cache, src: int, dsts: list[int]) -> None:
    """Copy every per-slot tensor of a DeepSeek-V4 cache (window ring, compressor and indexer
    state) from slot src to the slots dsts: each sibling then continues exactly where src stands.
    One copy per tensor for all siblings: one sibling at a time, the copies of n = 8 sampling were ~3,000
    launches and 43 ms of a 64-sequence rollout's host time (grpo_step.py --profile, H200)."""
    if not dsts:
        return
    idx = to_device(dsts, cache.layers[0].window.device)
    for layer in cache.layers:
        for t in layer.tensors():
            # the source slot copied out first: index_copy_ refuses a source that aliases t
            t.index_copy_(0, idx, t[src].clone().expand(len(dsts), *t.shape[1:]))


def available_memory_bytes(device) -> int:
    """Memory free on device now: CUDA's free memory, else the host's available memory (Linux
    MemAvailable, sysconf elsewhere; 4 GiB assumed where neither answers)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):  # macOS has no SC_AVPHYS_PAGES
        return 4 * 2**30


def describe(cache: CacheManager, max_model_len: int) -> str:
    """One line for the server's start: what the cache takes and holds."""
    return (f"{cache.nbytes / 2**30:.2f} GiB, room for {cache.full_sequences} sequences of {max_model_len} tokens "
            f"at once")


def slots_for_budget(bytes_per_slot: int, cache_memory_bytes: int | None, max_num_seqs: int) -> int:
    if cache_memory_bytes is None:
        return max_num_seqs
    n = cache_memory_bytes // bytes_per_slot
    if n < 1:
        raise ValueError(f"EngineConfig.cache_memory_bytes: {cache_memory_bytes} bytes do not hold one sequence's "
                         f"cache ({bytes_per_slot} bytes per slot at this max_model_len)")
    return min(n, max_num_seqs)


class SlotCacheManager:
    """Fixed-size per-sequence slots of a DeepSeek-V4 cache (`model.new_cache`)."""

    def __init__(self, model, max_model_len: int, max_num_seqs: int, cache_memory_bytes: int | None,
                 dtype: torch.dtype, device):
        probe = model.new_cache(1, max_model_len, dtype=dtype, device="meta")
        self.bytes_per_slot = probe.bytes_per_slot()
        self.num_blocks = slots_for_budget(self.bytes_per_slot, cache_memory_bytes, max_num_seqs)
        self.cache = model.new_cache(self.num_blocks, max_model_len, dtype=dtype, device=device)
        self.nbytes, self.full_sequences = self.num_blocks * self.bytes_per_slot, self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out slot 0 first
        self._dirty: set[int] = set()  # slots handed out since the last prepare(), still to be reset

    def prepare(self) -> None:
        """Reset the newly handed-out slots, all in one call per layer (before the step's forward):
        a reused slot still holds its previous owner's compressor state."""
        if self._dirty:
            self.cache.reset(to_device(sorted(self._dirty), self.cache.layers[0].window.device))
            self._dirty.clear()

    @property
    def scratch_slot(self) -> int:
        """The cache's extra slot (never handed out): padding rows of a CUDA-graph batch use it."""
        return self.num_blocks

    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return seq.slot is not None or bool(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        if seq.slot is not None:
            return
        if not self._free:
            raise OutOfCacheMemory(f"no free cache slot for {seq.seq_id}")
        seq.slot = self._free.pop()
        self._dirty.add(seq.slot)

    def fork_cost(self) -> int:
        return 1

    def fork(self, src: Sequence, dsts: list[Sequence]) -> None:
        for dst in dsts:
            self.allocate(dst, src.num_computed)
            self._dirty.discard(dst.slot)  # the copy overwrites all of the slot's state
        copy_slot(self.cache, src.slot, [dst.slot for dst in dsts])

    def free(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self._free.append(seq.slot)
            seq.slot = None

    def reset_all(self) -> None:
        self.cache.reset_all()
        self._dirty.clear()
