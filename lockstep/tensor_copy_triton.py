"""Many tensors copied in one Triton launch per alignment, as bytes: a weight update's write of its
unquantised weights (engine/weight_update.write_served, behind `WRITE_KERNEL`, on).

Why: torch's `_foreach_copy_` moves each tensor in chunks of its elements (8 bytes an access for
bf16) and launches once per group of chunks. Here each program copies CHUNK bytes of one pair
(dst, src) found through the tables of lockstep/tensor_tables.py, 16 bytes an access where every
address and size is a multiple of 16: the tensors that are go in one launch, the few that are not
(mHC's 3-value scales) byte by byte in another (`tensor_tables.alignment_groups`; with them in one
launch without the hint, gpu-848m's copy took 39 ms on an H100). A byte copy casts nothing: each
pair has one dtype and both sides are contiguous (`copyable`); the rest stays with torch's copy.
Bitwise a copy by definition (tests/test_tensor_copy_triton.py under the interpreter and on a GPU;
tests/gpu_compile.py compiles it for sm_90).

Measured (gpu-848m's 242 tensors, 1,709 MB, CUDA events, 2026-12-05; benchmarks/weight_update_parts.py
and a sweep of CHUNK / TILE / WARPS): one H200 1.20 ms against `_foreach_copy_`'s 1.63 and a flat
copy of the same bytes 0.81 (4 to 16 warps, 8 to 32 KB a step, 64 KB to 1 MB a program all within
1.20-1.28 ms, but 4 warps of 8 KB 1.42); one H100 1.53 against 1.78 (flat 1.14).
"""

from __future__ import annotations

import torch

from lockstep.tensor_tables import (PreparedLaunches, address_table, alignment_groups, call_key, chunk_table,
                                    open_gate)
from lockstep.triton_support import interpreted, load_triton

triton = load_triton()
if triton is not None:
    import triton.language as tl

    from lockstep.tensor_tables import table_int, table_pointer

WRITE_KERNEL = True  # write_served takes copy_many for the pairs it can copy (module docstring)
CHUNK = 65536  # bytes a program copies
TILE = 8192  # bytes a program moves per step: one 16-byte access a thread at WARPS 16
BYTE_CHUNK, BYTE_TILE = 8192, 1024  # an unaligned launch's (one byte an access; a few small tensors)
WARPS = 16  # the H200 sweep's best (module docstring)


def copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """copy_many can copy src into dst: `copyable_but_source_strides` and src contiguous."""
    return copyable_but_source_strides(dst, src) and src.is_contiguous()


def copyable_but_source_strides(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Triton present, one device on CUDA (or the interpreter), one dtype and shape, dst contiguous,
    outside torch.compile: all of `copyable` that a layout fixes (weight_update's WritePlan checks
    the sources' contiguity at each write)."""
    return (triton is not None and dst.dtype == src.dtype and dst.shape == src.shape and dst.device == src.device
            and (dst.is_cuda or interpreted()) and dst.is_contiguous() and not torch.compiler.is_compiling())


def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor], layout=None,
              gate: torch.Tensor | None = None, addresses: tuple | None = None) -> None:
    """dst.copy_(src) for every pair (each `copyable`), in a launch per alignment, prepared once per set
    of tensors (tensor_tables.PreparedLaunches). `layout`: a key the caller vouches fixes every
    pair's dtype and shape (weight_update's WritePlan), so that only the addresses are read per call
    (each tensor's full key was ~0.15 ms of host time for gpu-848m's 242 pairs, the device idle).
    `gate`: an int32 [1] on the device; where it holds anything but 0 when the launch runs, nothing
    is written (a weight update's checks close it: tensor_finite_triton.nonfinite_flags' gate).
    `addresses`: with `layout`, a key the caller vouches fixes every src's and dst's address
    (`tensor_tables.call_key`; a weight update's: the sources' read once per update, the
    destinations' once per WritePlan, as an engine's weights never move)."""
    key = call_key((interpreted(),), srcs, [(d,) for d in dsts], layout, addresses)
    gate = open_gate(dsts[0].device) if gate is None else gate
    _PREPARED.launch(_copy_kernel, key, lambda: _launches([(d, s) for d, s in zip(dsts, srcs) if s.numel()]),
                     extra=(gate,))


_PREPARED = PreparedLaunches()


def _launches(pairs) -> tuple[list, list]:
    """One launch per alignment group (tensor_tables.alignment_groups): the aligned bulk moves 16 bytes
    an access, a few odd tensors byte by byte in small tiles (a byte tile of TILE values spilled)."""
    if not pairs:
        return [], []
    sizes = [s.numel() * s.element_size() for _, s in pairs]
    device = pairs[0][1].device
    groups = alignment_groups([[s.data_ptr(), d.data_ptr()] for d, s in pairs], sizes)
    launches = []
    for align, positions in sorted(groups.items(), reverse=True):
        group = [pairs[i] for i in positions]
        chunk, tile = (CHUNK, TILE) if align > 1 else (BYTE_CHUNK, BYTE_TILE)
        tensor, local = chunk_table([sizes[i] for i in positions], chunk, device)
        addresses = address_table([[s.data_ptr() for _, s in group], [d.data_ptr() for d, _ in group],
                                   [sizes[i] for i in positions]], device)
        launches.append(((tensor.numel(),), (addresses, tensor, local, len(group)),
                         dict(CHUNK=chunk, TILE=tile, ALIGN=align, num_warps=WARPS)))
    return launches, []


if triton is not None:

    @triton.jit
    def _copy_kernel(addr_ptr, tensor_ptr, local_ptr, T, gate_ptr, CHUNK: tl.constexpr, TILE: tl.constexpr,
                     ALIGN: tl.constexpr):
        """Bytes [local * CHUNK, (local + 1) * CHUNK) of pair `tensor`: addr rows are the sources,
        the destinations and the sizes in bytes, T pairs each; none where the gate is closed (its
        bytes masked, left 0). The offsets within the chunk are int32 (the chunk's start is added
        to the pointers once): int64 offsets took a register each."""
        pid = tl.program_id(0)
        t = tl.load(tensor_ptr + pid)
        start = tl.load(local_ptr + pid).to(tl.int64) * CHUNK
        src = table_pointer(addr_ptr + t, 3, ALIGN) + start
        dst = table_pointer(addr_ptr + T + t, 3, ALIGN) + start
        left = tl.minimum(table_int(addr_ptr + 2 * T + t, ALIGN) - start, CHUNK).to(tl.int32)
        left = tl.where(tl.load(gate_ptr) == 0, left, 0)
        for step in tl.static_range(CHUNK // TILE):
            offs = step * TILE + tl.arange(0, TILE)
            mask = offs < left
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
