"""The trainer's own weights mapped into the engines of its host: a push that packs nothing.

The "shared" transport (shared_buckets.py) packs every pushed byte into buckets an engine maps:
the pack is a copy (read + write) and the engine then reads the bucket twice, once to validate it
and once to write its weights -- 2.5 copies of the pushed bytes at best, against issue 17's bar of
2. Processes of one host can skip the pack: the source exports the storage of each tensor the
trainer yields (`Trainer.named_weights()`: its live parameters, detached), and each engine maps
them and reads the trainer's memory in place -- a finiteness read and the write's copy, 1.5
copies. On CUDA the export is torch's CUDA IPC reduction of the tensor (as torch.multiprocessing
sends one); on the CPU the storage moves into shared memory once (torch's file-descriptor sharing,
`UntypedStorage._share_fd_cpu_`: an unlinked segment the source holds open; the trainer's
parameters keep their identity, optimizer state included) and a reader opens the source's
descriptor through /proc/PID/fd (same user, same host), so no name is left in /dev/shm and no
helper process runs (torch's file_system sharing starts torch_shm_manager, which outlived a
killed job in tests/dist/test_rank_killed.py). One descriptor per exported storage stays open in
the source (a few hundred for an 8-layer model). Reading another process's live tensors is what
colocated RL stacks do when they hand a training process's weights to a server by CUDA IPC handle
(SGLang's `update_weights_from_tensor`, verl's and slime's colocated modes).

Exports are made once and kept: a later push whose tensors are the same storages, views and dtypes
as the last (the trainer steps its parameters in place) offers no handles at all, and each engine
reads through the views it mapped before. A tensor whose dtype is not the push's wire dtype is cast
into a buffer kept from push to push (`wire`), so it too is exported once; the cast is a write
after the push began, so the offer says so and engines validate again what they read before it. A tensor that is new at
a push (a full tensor gathered from FSDP shards) is exported then, and the source keeps a reference
to every exported tensor until it exports another in its place: an address can then never be
reused by another tensor while an engine maps it, so equal addresses mean equal tensors.

The engine reads the trainer's memory while the push runs, so the source must not change it until
every engine has written: push_weights ends a mapped push at a barrier (weight_push.py).
"""

from __future__ import annotations

import os

import torch
from torch.multiprocessing.reductions import reduce_tensor


def _key(t: torch.Tensor) -> tuple:
    """What identifies an exported view: its address and layout. Equal keys of live tensors view the
    same bytes, since an exported tensor is kept alive (its address cannot be reused); the view's own
    address is taken, as the storage's costs a storage object per tensor (0.12 against 0.085 ms for
    gpu-848m's 234 parameters on this project's CPU machine)."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


def export_tensor(t: torch.Tensor) -> tuple:
    """A picklable handle to `t`'s memory: ("cuda", rebuild, args), torch's CUDA IPC reduction, or
    ("cpu", pid, fd, nbytes, dtype, offset, shape, stride), the storage moved into shared memory
    first if it was not there (in place: every view of it, `t` included, stays valid)."""
    if t.device.type == "cuda":
        rebuild, args = reduce_tensor(t)
        return ("cuda", rebuild, args)
    if t.device.type != "cpu":
        raise ValueError(f"cannot map a tensor on {t.device} into another process")
    fd, nbytes = t.untyped_storage()._share_fd_cpu_()
    return ("cpu", os.getpid(), fd, nbytes, t.dtype, t.storage_offset(), tuple(t.shape), t.stride())


def open_tensor(handle: tuple) -> torch.Tensor:
    """The tensor a handle of export_tensor names, mapped into this process (no copy)."""
    kind = handle[0]
    if kind == "cuda":
        _, rebuild, args = handle
        return rebuild(*args)
    if kind == "cpu":
        _, pid, fd, nbytes, dtype, offset, shape, stride = handle
        try:
            mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError as e:  # e.g. a /proc this process may not read: the shared transport needs no /proc
            raise ValueError(f"cannot map the trainer's tensor: opening /proc/{pid}/fd/{fd} failed ({e}); "
                             f"the weight push's shared transport does without it") from e
        try:  # the storage maps the segment through its own copy of the descriptor
            storage = torch.UntypedStorage._new_shared_fd_cpu(mine, nbytes)
        finally:
            os.close(mine)
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
    raise ValueError(f"unknown mapped tensor handle kind {kind!r}")


class MappedWeights:
    """One rank's side of mapped pushes, kept from push to push (or made for one): the source's
    exported tensors and their keys, a reader's mapped tensors."""

    def __init__(self):
        self._exported: list[torch.Tensor] = []  # the source's: kept alive while engines may map them
        self._keys: list[tuple] = []
        self._handles: list[tuple] = []
        self._offered = False  # the readers hold mappings of the current exports
        self._casts: dict[int, torch.Tensor] = {}  # the source's wire-dtype copies, by tensor index (wire)
        self._mapped: list[tuple[tuple, torch.Tensor]] = []  # a reader's (handle, tensor), in the offer's order

    def wire(self, tensors: list[torch.Tensor], dtypes: list[torch.dtype]) -> tuple[list[torch.Tensor], bool]:
        """The tensors in the push's wire dtypes: as they are where the dtype is already the wire's (the
        trainer's own weights: manifest.py), else cast into a buffer kept from push to push (in place:
        its address, so its export, stays); and whether a kept buffer was written (then what a reader
        read of it before this call is stale)."""
        out, rewritten = [], False
        for i, (t, dtype) in enumerate(zip(tensors, dtypes)):
            if t.dtype == dtype:
                out.append(t)
                continue
            buf = self._casts.get(i)
            if buf is None or buf.shape != t.shape or buf.dtype != dtype or buf.device != t.device:
                buf = self._casts[i] = torch.empty(t.shape, dtype=dtype, device=t.device)
            else:
                rewritten = True
            out.append(buf.copy_(t))
        return out, rewritten

    def offer(self, tensors: list[torch.Tensor]) -> list[tuple] | None:
        """The source: handles for the readers to map, or None where they map these tensors already.
        Only tensors that changed since the last offer are exported again."""
        keys = [_key(t) for t in tensors]
        if keys == self._keys and self._offered:
            return None
        old = dict(zip(self._keys, self._handles))
        handles = [old[k] if k in old else export_tensor(t) for k, t in zip(keys, tensors)]
        # a CPU export can move the storage (into shared memory): the key is taken after it
        self._exported, self._keys, self._handles = list(tensors), [_key(t) for t in tensors], handles
        self._offered = True
        return handles

    def handles(self) -> list[tuple]:
        """The source: the handles of its current exports (after `offer`)."""
        return self._handles

    def reader_tensors(self, handles: list[tuple] | None) -> list[torch.Tensor]:
        """A reader: the source's tensors, by the handles offered now (a handle mapped before is not
        mapped again), or None: the last push's."""
        if handles is not None:
            before = dict(self._mapped)
            self._mapped = [(h, before[h] if h in before else open_tensor(h)) for h in handles]
        elif not self._mapped:
            raise RuntimeError("the source offered no handles and this rank has mapped none")
        return [t for _, t in self._mapped]

    def mapped(self) -> bool:
        """A reader holds mappings from an earlier offer."""
        return bool(self._mapped)

    def unmap(self) -> None:
        """A reader drops its mappings."""
        self._mapped = []

    def free(self) -> None:
        """The source forgets its exports (the next offer exports again)."""
        self._exported, self._keys, self._handles, self._offered, self._casts = [], [], [], False, {}
