"""Count the points where a block of code would make the host wait for a GPU, on any device.

    with SyncAudit() as audit:
        engine.step()
    audit.counts  # {"value_reads": 1, "sync_ops": 0, "h2d_blocking": 0, "h2d_async": 2}

On a GPU each of these drains the launch queue (the GPU idles while Python catches up), but a
CPU run does not show them; this audit does, so CPU tests can pin the decode step's syncs:
- value_reads: Python reads a tensor's values (`.tolist()`, `.item()`, `int(t)`, `float(t)`,
  `bool(t)`, `.cpu()`, `.numpy()`);
- sync_ops: ops whose output size depends on the values or that read them internally
  (`nonzero`, boolean-mask indexing, `masked_select`, `unique`, `bincount`, `repeat_interleave`
  without output_size, `_local_scalar_dense` reached without a Python read);
- h2d_blocking: a tensor built from Python data copied to the device without non_blocking
  (`torch.tensor(x, device=d)`, `t.to(d)`): CUDA synchronises the stream before a copy from
  pageable memory. h2d_async: the pinned non_blocking copies that do not stall.
A CPU op's own host reads (e.g. the CPU fallback of torch._grouped_mm) happen below the
dispatcher level this audit watches, so they are not counted: the CUDA kernels do not sync.
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

VALUE_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}
SYNC_OPS = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
            "bincount", "_local_scalar_dense"}


class _Reads(TorchFunctionMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts
        self._host_born: dict[int, weakref.ref] = {}  # tensors built from Python data on the host
        self.reading = 0  # > 0 while inside a counted read (its aten::_local_scalar_dense is the same sync)

    def _mark(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self._host_born[id(t)] = weakref.ref(t)

    def _host(self, t) -> bool:
        ref = self._host_born.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in VALUE_READS:
            self.counts["value_reads"] += 1
            self.reading += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.reading -= 1
        out = func(*args, **kwargs)
        if name in ("tensor", "as_tensor") and args and not isinstance(args[0], torch.Tensor):
            if kwargs.get("device") is not None:
                self.counts["h2d_blocking"] += 1
            else:
                self._mark(out)
        elif name == "pin_memory" and self._host(args[0]):
            self._mark(out)
        elif name in ("to", "cuda") and self._host(args[0]) and _names_device(args[1:], kwargs):
            self.counts["h2d_async" if kwargs.get("non_blocking") else "h2d_blocking"] += 1
        elif name == "copy_" and len(args) > 1 and self._host(args[1]):
            non_blocking = kwargs.get("non_blocking") or (len(args) > 2 and args[2])
            self.counts["h2d_async" if non_blocking else "h2d_blocking"] += 1
        return out


def _names_device(args, kwargs) -> bool:
    first = args[0] if args else None
    return isinstance(first, (str, torch.device)) or "device" in kwargs


class _SyncOps(TorchDispatchMode):
    def __init__(self, counts: collections.Counter, reads: _Reads):
        super().__init__()
        self.counts, self.reads = counts, reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS and not (name == "_local_scalar_dense" and self.reads.reading):
            self.counts["sync_ops"] += 1
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args):
            self.counts["sync_ops"] += 1  # a boolean mask index is a nonzero
        elif name == "repeat_interleave" and (kwargs or {}).get("output_size") is None:
            self.counts["sync_ops"] += 1
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class SyncAudit:
    """Context manager; `counts` holds value_reads, sync_ops, h2d_blocking, h2d_async."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self._reads = _Reads(self.counts)
        self._ops = _SyncOps(self.counts, self._reads)

    @property
    def syncs(self) -> int:
        """Every point where the host would wait for the device."""
        return self.counts["value_reads"] + self.counts["sync_ops"] + self.counts["h2d_blocking"]

    def __enter__(self) -> "SyncAudit":
        self._reads.__enter__()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ops.__exit__(*exc)
        self._reads.__exit__(*exc)
