"""Host <-> device copies that never stall the GPU's launch queue.

A blocking copy of a Python-built tensor to a CUDA device (`torch.tensor(x, device="cuda")`,
`t.to("cuda")`) synchronises the stream first: the host waits until every queued kernel has
run, and the GPU then idles while the host prepares the next step. A copy from pinned
(page-locked) memory with non_blocking=True is queued like a kernel instead; PyTorch's pinned
allocator keeps the staging buffer alive until the copy has run. Device -> host results use
the same trick (`to_host_async`): valid once a later blocking read on the stream has returned,
which the sampler's one read per step provides.
"""

from __future__ import annotations

import torch


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """A list (or nested lists) of Python numbers, or a numpy array -> a tensor on `device`,
    queued without a sync."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)  # on the CPU: t itself


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of t queued on the current stream; read it only after a later sync."""
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


class HostRead:
    """A device tensor's values on their way to the host: the copy is queued now, `values()` waits
    for that copy alone (a CUDA event), not for the work queued on the stream after it. Where a
    blocking read (`.tolist()` on the device tensor) would wait for everything queued so far,
    this lets the host read one window's tokens while the GPU already runs the next.
    `values()` counts as the one value read of the tensor (sync_audit.py)."""

    def __init__(self, t: torch.Tensor):
        self._host = to_host_async(t)
        self._done = None
        if t.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def values(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


def copy_into(dst: torch.Tensor, values) -> None:
    """Write Python numbers into an existing (contiguous) device tensor without a sync."""
    t = torch.tensor(values, dtype=dst.dtype)
    dst.copy_(t.pin_memory() if dst.is_cuda else t, non_blocking=True)
