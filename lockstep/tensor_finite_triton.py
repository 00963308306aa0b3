"""Which of many float tensors hold a NaN or an inf, in one Triton launch per dtype and alignment:
the weight update's finiteness check (engine/value_checks.launch_finiteness, behind `FINITE_KERNEL`,
on).

Why: torch's form is one `_foreach_norm` per dtype group (then isfinite of the norms), a read of
every weight in chunks of elements with a launch per group of chunks; here each program reads CHUNK
values of one tensor through the tables of lockstep/tensor_tables.py (16-byte accesses where
aligned: `tensor_tables.alignment_groups`) and, where a value is not finite (x - x is NaN exactly
for NaN and +-inf), raises its tensor's flag. Exact where the norm is not: a norm overflows to inf
for finite values above ~1e19 in fp32, which the norm's path then has to count. Tests:
tests/test_tensor_finite_triton.py (under the interpreter and on a GPU), tests/gpu_compile.py (sm_90).

Measured (gpu-848m's 240 bf16 tensors, 1,709 MB, CUDA events, one H200, 2026-12-05): 0.50 ms against
the norms' 0.94 and a read-only sum of the same bytes 0.42 (CHUNK 32K values, 2 to 8 K a step, 4 or 8
warps all 0.49-0.54; 128 K-value programs at 4 warps 3.3-3.9 ms).
"""

from __future__ import annotations

import torch

from lockstep.tensor_tables import W_DTYPES, PreparedLaunches, address_table, alignment_groups, call_key, chunk_table
from lockstep.triton_support import interpreted, load_triton

triton = load_triton()
if triton is not None:
    import triton.language as tl

    from lockstep.tensor_tables import table_int, table_pointer

FINITE_KERNEL = True  # weight_update's finiteness check takes nonfinite_flags (module docstring)
CHUNK = 32768  # values a program reads
TILE = 4096  # values a program reads per step
WARPS = 4


def checkable(tensors: list[torch.Tensor]) -> bool:
    """nonfinite_flags can read these: Triton present, one dtype of W_DTYPES and one CUDA device (or the
    interpreter), each contiguous, outside torch.compile."""
    return (triton is not None and bool(tensors) and tensors[0].dtype in W_DTYPES
            and not torch.compiler.is_compiling()
            and all(t.dtype == tensors[0].dtype and t.device == tensors[0].device and t.is_contiguous()
                    for t in tensors)
            and (tensors[0].is_cuda or interpreted()))


def nonfinite_flags(tensors: list[torch.Tensor], layout=None, gate: torch.Tensor | None = None,
                    addresses: tuple | None = None) -> torch.Tensor:
    """int32 [len(tensors)] on their device, 1 where a tensor holds a NaN or an inf, else 0; launched,
    not waited for (each `checkable` together). `layout`, `addresses`: keys the caller vouches fix
    every tensor's dtype and shape, and address (tensor_copy_triton.copy_many's, likewise). `gate`: an
    int32 [1] the kernel raises to 1 where any value is not finite, so that a write gated on it
    (copy_many's `gate`) writes nothing, with no wait for the flags in between (engine/weight_update.py)."""
    flags = torch.zeros(len(tensors) + (gate is None), dtype=torch.int32, device=tensors[0].device)
    gate = flags[-1:] if gate is None else gate
    _PREPARED.launch(_nonfinite_kernel, call_key((interpreted(),), tensors, [], layout, addresses),
                     lambda: _launches(tensors), extra=(flags, gate))
    return flags[:len(tensors)]


_PREPARED = PreparedLaunches()


def _launches(tensors) -> tuple[list, list]:
    """The launches without their flags (nonfinite_flags passes a zeroed buffer each call), one per
    alignment group (tensor_tables.alignment_groups); an empty tensor is read by none."""
    positions = [i for i, t in enumerate(tensors) if t.numel()]
    tensors = [tensors[i] for i in positions]
    sizes = [t.numel() for t in tensors]
    device = tensors[0].device if tensors else None
    launches = []
    for align, group in sorted(alignment_groups([[t.data_ptr()] for t in tensors], sizes).items(), reverse=True):
        tensor, local = chunk_table([sizes[i] for i in group], CHUNK, device)
        addresses = address_table([[tensors[i].data_ptr() for i in group], [sizes[i] for i in group],
                                   [positions[i] for i in group]], device)
        launches.append(((tensor.numel(),), (addresses, tensor, local, len(group)),
                         dict(KIND=W_DTYPES[tensors[0].dtype], CHUNK=CHUNK, TILE=TILE, ALIGN=align, num_warps=WARPS)))
    return launches, []


if triton is not None:

    @triton.jit
    def _nonfinite_kernel(addr_ptr, tensor_ptr, local_ptr, T, flags_ptr, gate_ptr, KIND: tl.constexpr,
                          CHUNK: tl.constexpr, TILE: tl.constexpr, ALIGN: tl.constexpr):
        """Values [local * CHUNK, (local + 1) * CHUNK) of tensor `tensor`: addr rows are the addresses,
        the sizes in values and each tensor's flag index, T tensors each. Offsets within the chunk
        are int32, its start added to the pointer once (as tensor_copy_triton's)."""
        pid = tl.program_id(0)
        t = tl.load(tensor_ptr + pid)
        start = tl.load(local_ptr + pid).to(tl.int64) * CHUNK
        x_ptr = table_pointer(addr_ptr + t, KIND, ALIGN) + start
        left = tl.minimum(table_int(addr_ptr + T + t, ALIGN) - start, CHUNK).to(tl.int32)
        bad = tl.zeros([TILE], dtype=tl.int32)
        for step in tl.static_range(CHUNK // TILE):
            offs = step * TILE + tl.arange(0, TILE)
            x = tl.load(x_ptr + offs, mask=offs < left, other=0.0).to(tl.float32)
            bad = tl.maximum(bad, ((x - x) != 0.0).to(tl.int32))
        if tl.max(bad, axis=0) > 0:
            tl.atomic_max(flags_ptr + tl.load(addr_ptr + 2 * T + t), 1)
            tl.atomic_max(gate_ptr, 1)
