"""Paged KV cache memory (vLLM's block manager) for models with a per-token KV cache (Llama).

Physical memory is `num_blocks` blocks of `block_size` token positions; a sequence's block
table maps its logical block j (positions j*bs .. j*bs + bs - 1) to a physical block. Blocks
are reference-counted so that the n samples of one prompt share the prompt's full blocks:
a full block is never written again (writes only go to positions >= num_computed), so
sharing it is safe; only the partially filled last block is copied at fork time.
"""

from __future__ import annotations

import math

from lockstep.engine.kv_cache import OutOfCacheMemory
from lockstep.engine.request import Sequence


class PagedCacheManager:
    def __init__(self, kv_cache, num_blocks: int, block_size: int, blocks_per_sequence: int):
        self.kv = kv_cache  # exposes .k / .v [layers, num_blocks, block_size, ...]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.nbytes = kv_cache.k.nbytes + kv_cache.v.nbytes
        self.full_sequences = num_blocks // blocks_per_sequence
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    def num_free_blocks(self) -> int:
        return len(self._free)

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, math.ceil(num_tokens / self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self._blocks_needed(seq, num_tokens) <= len(self._free)

    def _take(self) -> int:
        if not self._free:
            raise OutOfCacheMemory("no free KV block")
        b = self._free.pop()
        self._refs[b] = 1
        return b

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        if self._blocks_needed(seq, num_tokens) > len(self._free):
            raise OutOfCacheMemory(f"{seq.seq_id} needs {self._blocks_needed(seq, num_tokens)} blocks, "
                                   f"{len(self._free)} free")
        for _ in range(self._blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take())

    def fork_cost(self) -> int:
        return 1  # at most the partial last block is copied

    def fork(self, src: Sequence, dsts: list[Sequence]) -> None:
        full = src.num_computed // self.block_size
        shared = src.block_table[:full]
        for dst in dsts:
            for b in shared:
                self._refs[b] += 1
            dst.block_table = list(shared)
            if src.num_computed % self.block_size:
                b = self._take()
                s = src.block_table[full]
                self.kv.k[:, b].copy_(self.kv.k[:, s])
                self.kv.v[:, b].copy_(self.kv.v[:, s])
                dst.block_table.append(b)

    def free(self, seq: Sequence) -> None:
        for b in seq.block_table:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
        seq.block_table = []

    def reset_all(self) -> None:
        self.kv.k.zero_()
        self.kv.v.zero_()
