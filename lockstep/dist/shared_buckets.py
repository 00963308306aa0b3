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

Lifetime: the source keeps every bucket until every rank has written the update (the release
barrier in weight_push.py), so the push's one staging copy sits on the source, not on each engine.
A CPU segment is unlinked as soon as every reader has mapped it (a barrier per bucket), so a
process killed mid-push leaves at most the bucket being packed in /dev/shm.
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shm_open, what multiprocessing.shared_memory is built on
import mmap
import os
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

TRANSPORTS = ("auto", "broadcast", "shared")


def one_host(ctx) -> bool:
    """Every rank of the world runs on this host (torchrun's LOCAL_WORLD_SIZE is the world's size)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == ctx.world_size


def resolve_transport(ctx, requested: str = "auto") -> str:
    """"shared" or "broadcast" for this world. auto: shared where the weight group would broadcast
    over gloo (host staging) and every rank is on this host; NCCL's broadcast is kept where it runs."""
    if requested not in TRANSPORTS:
        raise ValueError(f"weight push transport must be one of {TRANSPORTS}, got {requested!r}")
    if requested == "shared" and not one_host(ctx):
        raise ValueError(f"rank {ctx.rank}: the shared weight-push transport needs every rank on one host "
                         f"(LOCAL_WORLD_SIZE {os.environ.get('LOCAL_WORLD_SIZE')} != world size {ctx.world_size})")
    if requested != "auto":
        return requested
    # ranks outside the weight group have no say (True); every rank learns the one answer
    mine = ctx.weight_group is None or (dist.get_backend(ctx.weight_group) == "gloo" and one_host(ctx))
    return "shared" if ctx.all_true(mine, "weight push transport") else "broadcast"


class SharedBucket:
    """The source's side: `tensor` (uint8, `nbytes`) to pack into, `handle()` for the others."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        self._shm, self._unlinked = None, False
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            self._shm = SharedMemory(create=True, size=max(nbytes, 1))
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)

    def handle(self) -> tuple:
        """Picklable: ("cuda", rebuild, args) from torch's CUDA IPC reduction, or ("shm", name, nbytes)."""
        if self._shm is None:
            rebuild, args = reduce_tensor(self.tensor)
            return ("cuda", rebuild, args)
        return ("shm", self._shm.name, self.nbytes)

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
