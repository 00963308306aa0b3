"""FSDP2's all-gather and reduce-scatter staged through host memory, for CUDA tensors over gloo.

Two processes sharing one GPU cannot use NCCL ("Duplicate GPU detected"), so their groups are gloo
(lockstep.dist.groups). On torch 2.11 an FSDP2 step there killed both ranks with SIGSEGV (the stack
faulthandler printed: DTensor's functional all-gather, `wait_tensor`, of CUDA tensors over gloo),
while the same collectives on CPU tensors are gloo's everyday path. FSDP2's own all-gather and
reduce-scatter take gloo's CUDA path from FSDP's side streams; rather than rely on it, these comms
(FSDP2's
`set_custom_all_gather` / `set_custom_reduce_scatter` hooks) copy the flat buffer FSDP hands them to
the host on the stream FSDP runs them on, run the collective on the CPU tensor, and copy the result
back on that stream: FSDP's events then order the copies as they order its own collectives.
(`moves_cuda_over_gloo`, the rule for when, and `gather_full`, the same staging for a DTensor's
full_tensor, live in lockstep.train.data_parallel: the trainer gathers shards itself.)

Numerics are those of the default comms: gloo reduces the same fp32 (reduce_dtype) values in the
same rank order whether they live on the host or the device, and an all-gather only moves bytes.
The collectives run synchronously (no Work returned; FSDP waits for none), which costs overlap but
nothing else on a path that exists for correctness checks on one GPU, not for speed.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _HostAlloc:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class HostStagedAllGather(_HostAlloc, AllGather):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        host_out = torch.empty(output_tensor.shape, dtype=output_tensor.dtype)
        dist.all_gather_into_tensor(host_out, input_tensor.cpu(), group=group)
        output_tensor.copy_(host_out)


class HostStagedReduceScatter(_HostAlloc, ReduceScatter):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> None:
        host_out = torch.empty(output_tensor.shape, dtype=output_tensor.dtype)
        dist.reduce_scatter_tensor(host_out, input_tensor.cpu(), op=op, group=group)
        output_tensor.copy_(host_out)
