"""Tables of a many-tensor Triton kernel: one launch over many tensors, each program finding its
tensor and its addresses in tables on the device (the push's fp8 / fp4 re-quantisation,
quant/fp8_triton.py and fp4_triton.py; MasterAdamW's update, train/adamw_triton.py).

Host side: `launch_table` (which tensor each program works on, and its index within it: by the
shapes only, so kept per set of shapes), `address_table` (each tensor's addresses and strides),
`alignment` (whether a launch may tell the compiler its addresses and sizes are multiples of ALIGN),
`PreparedLaunches` (a call's launches kept by its tensors' `tensor_key`s: a push re-quantises the
same sources into the same storage every time). Kernel side: `table_pointer` / `table_int` read an
address or a size from a table with that hint. Why the hint: a pointer read from a table is of unknown alignment, and
every load and store through it went one element at a time (sm_90 PTX; the fp8 re-quantisation of
gpu-848m's push took 6.3 ms on an H200); with it, 16 bytes at a time (tests/gpu_compile.py checks).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from lockstep.triton_support import load_triton

triton = load_triton()
if triton is not None:
    import triton.language as tl

W_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # table_pointer's KIND of a float tensor
ALIGN = 16  # bytes of an address, elements of a stride or a row: a 16-byte vector for every dtype here


def alignment(addresses: list[int], sizes: list[int]) -> int:
    """A launch's ALIGN: ALIGN where every address and size is a multiple of it (a tensor's own
    storage, rows of a multiple of 16 values), else 1 (no alignment known)."""
    return ALIGN if all(v % ALIGN == 0 for v in (*addresses, *sizes)) else 1


def alignment_groups(addresses: list[list[int]], sizes: list[int]) -> dict[int, list[int]]:
    """Item positions by their `alignment` (item i: its tensors' addresses and its size): a launch per
    group, so that one odd item (mHC's 3-value scales: 12 bytes) does not take the hint from every
    other tensor of the launch (the update's byte copy of gpu-848m ran at 44 GB/s unaligned)."""
    groups: dict[int, list[int]] = {}
    for i, (addrs, size) in enumerate(zip(addresses, sizes)):
        groups.setdefault(alignment(addrs, [size]), []).append(i)
    return groups


def open_gate(device: torch.device) -> torch.Tensor:
    """A write gate that stays 0, never written: the `gate` of a many-tensor write no check gates (a
    gated write, engine/value_checks.DeviceChecks, writes nothing where its gate is not 0). Kept per
    device, except one made while a CUDA graph is captured: it lives in the graph's memory pool."""
    gate = _OPEN_GATES.get(device)
    if gate is None:
        gate = torch.zeros(1, dtype=torch.int32, device=device)
        if not (gate.is_cuda and torch.cuda.is_current_stream_capturing()):
            _OPEN_GATES[device] = gate
    return gate


_OPEN_GATES: dict[torch.device, torch.Tensor] = {}


def unit_stride(t: torch.Tensor, shape: tuple, copies: list[torch.Tensor]) -> torch.Tensor:
    """t as `shape` with its last stride 1 (the kernels read rows): a view of t where one is, else a
    copy, noted in `copies` (kept alive for the launch, which is then not kept: PreparedLaunches).
    A reshape that had to copy counts too: a transposed fp4 expert's rows, read from reshape's
    temporary after it was freed, were garbage."""
    rows = t.reshape(shape)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        copies.append(rows)
    return rows


def tensor_key(t: torch.Tensor) -> tuple:
    """All a launch reading or writing t through a table depends on: its address, dtype, shape, strides."""
    return t.data_ptr(), t.dtype, t.shape, t.stride()


def call_key(settings: tuple, ws: list[torch.Tensor], outs: list[tuple[torch.Tensor, ...]], layout=None,
             addresses: tuple | None = None) -> tuple:
    """A many-tensor call's key for PreparedLaunches: its settings and every tensor's tensor_key; where
    the caller vouches (`layout`) that every tensor's dtype, shape and strides are fixed, the layout
    and the tensors' addresses only (a weight update's kept plans: each tensor's full key was ~0.15
    ms of host time for gpu-848m's 242 tensors, the device idle), or with the layout a key the caller
    vouches fixes every address (`addresses`: a weight update's, read once for all its launches)."""
    if layout is not None and addresses is not None:
        return (*settings, layout, addresses)
    if layout is not None:
        return (*settings, layout, *[t.data_ptr() for t in ws], *[t.data_ptr() for pair in outs for t in pair])
    return (*settings, *map(tensor_key, ws), *(tensor_key(t) for pair in outs for t in pair))


class PreparedLaunches:
    """A many-tensor kernel's launches (grid, arguments, constexprs), kept by a `call_key`: the same
    key launches the same work, so a hit skips the per-tensor preparation (gpu-848m's weights, host
    time a call on this project's CPU machine with the kernel a no-op: fp8 1.24 -> 0.60 ms through
    quant/fp8.py's checks, fp4 1.15 -> 0.23 ms; a push's device work waits for it). The launches
    hold the device tables, never the tensors, so a kept entry keeps no weights alive. A few
    entries, the oldest dropped first."""

    def __init__(self, size: int = 8):
        self.size, self._entries = size, {}

    def launch(self, kernel, key: tuple, prepare, extra: tuple = ()) -> None:
        """Launch the kept launches of `key`, else prepare() -> (launches, the temporary copies they
        read): kept unless they read a temporary (its address is the call's only). `extra`: arguments
        of this call only (an output made per call), passed after each launch's kept ones."""
        if self.launch_kept(kernel, key, extra):
            return
        launches, copies = prepare()
        if not copies:
            if len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = launches
        _run(kernel, launches, extra)

    def launch_kept(self, kernel, key: tuple, extra: tuple = ()) -> bool:
        """Launch the kept launches of `key` where there are: whether there were (a caller whose
        checks passed for the same key before skips them)."""
        launches = self._entries.get(key)
        if launches is not None:
            _run(kernel, launches, extra)
        return launches is not None


def _run(kernel, launches: list, extra: tuple) -> None:
    if _HELD is not None:
        _HELD.append((launches, extra))
    for grid, args, constexprs in launches:
        kernel[grid](*args, *extra, **constexprs)


_HELD: list | None = None


@contextlib.contextmanager
def holding():
    """Every launch made inside, its arguments (the device tables) kept in the yielded list: a CUDA
    graph captured inside reads them by address, so they must live as long as it does, whatever
    PreparedLaunches drops (engine/update_replay.py)."""
    global _HELD
    outer, _HELD = _HELD, []
    try:
        yield _HELD
    finally:
        if outer is not None:
            outer.extend(_HELD)
        _HELD = outer


@functools.lru_cache(maxsize=64)
def launch_table(counts: tuple[int, ...], meta: tuple[tuple[int, ...], ...],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A many-tensor launch's tables on the device, made once per set of shapes: (tensor index int32
    [P], the program's index within its tensor int32 [P], meta int64 [T, len(meta[t])]) for counts[t]
    programs of each tensor t."""
    n = torch.tensor(counts)
    tensor = torch.repeat_interleave(torch.arange(len(counts)), n)
    local = torch.cat([torch.arange(c) for c in counts]) if counts else torch.zeros(0, dtype=torch.int64)
    return (tensor.to(device, torch.int32), local.to(device, torch.int32),
            torch.tensor(meta, dtype=torch.int64, device=device))


def chunk_table(sizes: list[int], chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """launch_table's (tensor index, index within it) for ceil(size / chunk) programs per tensor: a
    launch that walks each tensor in chunks (the update's byte copy and finiteness check)."""
    tensor, local, _ = launch_table(tuple(-(-n // chunk) for n in sizes), tuple((n,) for n in sizes), device)
    return tensor, local


def address_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Rows of int64 (each tensor's addresses, strides) for a many-tensor kernel, on the device."""
    return torch.tensor(rows, dtype=torch.int64).to(device)


if triton is not None:

    @triton.jit
    def table_int(ptr, ALIGN: tl.constexpr):
        """The int64 at ptr (a stride or a size the host checked to be a multiple of ALIGN), marked as
        one for the compiler; the hint holds only on a value made by an op of the same function,
        hence the load here."""
        v = tl.load(ptr)
        if ALIGN > 1:
            v = tl.multiple_of(v, ALIGN)
        return v

    @triton.jit
    def table_pointer(ptr, KIND: tl.constexpr, ALIGN: tl.constexpr):
        """The address at ptr as a typed pointer (KIND: W_DTYPES' bf16 0 / fp16 1 / fp32 2, bytes 3),
        marked as a multiple of ALIGN bytes (the module docstring says why)."""
        if KIND == 0:
            p = tl.load(ptr).to(tl.pointer_type(tl.bfloat16))
        elif KIND == 1:
            p = tl.load(ptr).to(tl.pointer_type(tl.float16))
        elif KIND == 2:
            p = tl.load(ptr).to(tl.pointer_type(tl.float32))
        else:
            p = tl.load(ptr).to(tl.pointer_type(tl.uint8))
        if ALIGN > 1:
            p = tl.multiple_of(p, ALIGN)
        return p
