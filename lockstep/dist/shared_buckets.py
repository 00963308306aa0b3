"""Weight-push buckets handed over by handle between the processes of one host, not broadcast.

Where the weight group is gloo -- CPU ranks, or ranks sharing one GPU (NCCL refuses two ranks on a
device) -- a broadcast stages every byte through host memory and a socket: 0.54 s for the 1.7 GB of
gpu-848m on one H200, 665x a device copy of the same bytes (benchmarks/weight_push.py). Processes
of one host can map the source's memory instead. The source packs each bucket into memory it can
share -- on CUDA any device allocation, exported through CUDA IPC as torch.multiprocessing sends a
CUDA tensor; on the CPU a POSIX shared-memory segment -- and sends only the handle; each engine
stages views of the mapped bytes and reads them once, when it writes its weights. This is how
colocated RL stacks hand weights from the training process to the inference server (SGLang's
`update_weights_from_tensor` takes CUDA IPC handles of flattened buckets; slime's colocated mode).
The mapped transport (mapped_weights.py) skips the pack: engines read the trainer's own tensors.

Lifetime: the source keeps every bucket until every rank has written the update, so the push's one
staging copy sits on the source, not on each engine. A `BucketPool` holds one rank's buckets (the
source's allocations, a reader's mappings and the tensor views cut from them). A pool made for one
push is freed at its end (weight_push.py's release barrier: every engine has written). A pool kept
from push to push allocates, exports and maps its buckets once and
reuses them: each later push only packs, one drain, one small broadcast. On one H200 the buckets'
allocation, CUDA IPC export / open, a broadcast and a barrier per bucket and their views were most
of gpu-848m's 17 ms bf16 push (benchmarks/weight_push.py, 2026-12-04). The cost: the source holds
the staging copy (the pushed weights' bytes) between pushes too. Reuse is safe because no rank packs
before every engine has written the previous push (a push starts with a collective every rank joins
only after finishing the previous one). A CPU segment is unlinked as soon as every reader has mapped
it, so a process killed mid-push leaves at most one push's buckets in /dev/shm.
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shm_open, what multiprocessing.shared_memory is built on
import mmap
import os
from multiprocessing.shared_memory import SharedMemory

import torch
from torch.multiprocessing.reductions import reduce_tensor

class SharedBucket:
    """The source's side: `tensor` (uint8, `nbytes`, zeroed) to pack into, `handle()` for the others."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        self._shm, self._unlinked, self._handle = None, False, None
        if device.type == "cuda":
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        else:  # a new segment reads as zeros
            self._shm = SharedMemory(create=True, size=max(nbytes, 1))
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)

    def handle(self) -> tuple:
        """Picklable: ("cuda", rebuild, args) from torch's CUDA IPC reduction, or ("shm", name, nbytes).
        Made once: a CUDA export is an IPC handle and an event, and a reader maps each handle once."""
        if self._handle is None:
            if self._shm is None:
                rebuild, args = reduce_tensor(self.tensor)
                self._handle = ("cuda", rebuild, args)
            else:
                self._handle = ("shm", self._shm.name, self.nbytes)
        return self._handle

    def mapped_everywhere(self) -> None:
        """Every reader has mapped the bucket: a shared-memory segment loses its name now (the mappings
        keep it alive), so a source that dies later leaks nothing into /dev/shm."""
        if self._shm is not None and not self._unlinked:
            self._shm.unlink()
            self._unlinked = True

    def release(self) -> None:
        """Free the bucket: every reader has dropped its views (after the release barrier)."""
        self.tensor = None
        if self._shm is not None:
            self.mapped_everywhere()
            self._shm.close()
            self._shm = None


def _attach(name: str) -> mmap.mmap:
    """Map the source's segment `name` without registering it with a resource tracker: Python < 3.13's
    SharedMemory(name=...) does, and the tracker then unlinks the source's segment when this process
    exits (or, where processes share one tracker, fails on the source's own unregister)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class MappedBucket:
    """A reader's side: `tensor`, the source's bucket mapped into this process."""

    def __init__(self, handle: tuple):
        kind = handle[0]
        self._shm = None
        if kind == "cuda":
            _, rebuild, args = handle
            self.tensor = rebuild(*args)
        elif kind == "shm":
            _, name, nbytes = handle
            self._shm = _attach(name)
            self.tensor = torch.frombuffer(self._shm, dtype=torch.uint8, count=nbytes)
        else:
            raise ValueError(f"unknown shared bucket handle kind {kind!r}")

    def close(self) -> None:
        """Unmap; the caller has dropped every view of `tensor` (a CPU mapping refuses to close otherwise)."""
        self.tensor = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None


class BucketPool:
    """One rank's shared buckets, for one push or kept from push to push (module docstring): the
    source's `SharedBucket`s, a reader's `MappedBucket`s, and views cut from either (`views`)."""

    def __init__(self):
        self._own: list[SharedBucket] = []
        self._announced = False  # every reader has mapped the source's current buckets
        self._mapped: list[tuple[tuple, MappedBucket]] = []  # (handle, mapping) in bucket order
        self._views: dict = {}  # cut from the current buffers; emptied whenever they change

    def source_buffers(self, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
        """The source's buffers for buckets of these byte sizes: allocated at the first push, or when
        the buckets changed (the old ones freed first), else the last push's."""
        if [b.nbytes for b in self._own] != sizes or any(b.tensor.device != device for b in self._own):
            self.free()
            self._own = [SharedBucket(n, device) for n in sizes]
        return [b.tensor for b in self._own]

    def offer(self) -> tuple[list[tuple], bool]:
        """What the source broadcasts: its buckets' handles, and whether some reader may not have
        mapped them yet (then every rank meets at a barrier and the source calls mapped_everywhere)."""
        return [b.handle() for b in self._own], not self._announced

    def mapped_everywhere(self) -> None:
        for b in self._own:
            b.mapped_everywhere()
        self._announced = True

    def reader_buffers(self, handles: list[tuple]) -> list[torch.Tensor]:
        """The source's buckets mapped into this process: a handle mapped before is not mapped again."""
        if [h for h, _ in self._mapped] != handles:
            kept = {i: m for i, (h, m) in enumerate(self._mapped) if i < len(handles) and h == handles[i]}
            self._views = {}
            for i, (_, m) in enumerate(self._mapped):
                if i not in kept:
                    m.close()
            self._mapped = [(h, kept[i] if i in kept else MappedBucket(h)) for i, h in enumerate(handles)]
        return [m.tensor for _, m in self._mapped]

    def views(self, key, cut):
        """`cut()`'s views of the current buffers, cut once per key while the buffers stay the same."""
        if key not in self._views:
            self._views[key] = cut()
        return self._views[key]

    def unmap(self) -> None:
        """A reader drops its views and mappings (before the source frees the buckets)."""
        self._views = {}
        for _, m in self._mapped:
            m.close()
        self._mapped = []

    def free(self) -> None:
        """The source frees its buckets: every reader has unmapped them (or is gone)."""
        self._views = {}
        for b in self._own:
            b.release()
        self._own, self._announced = [], False
