"""`DataParallel`: the trainer's view of its data-parallel ranks, the sums that make N ranks one step.

Each rank's `Trainer.train_step` gets its own samples; the step must still be the step one process
would take on all of them, micro-batch by micro-batch. What has to cross ranks, and why:

    loss normalisers   token / sample counts summed, max_len maxed: every rank's loss is (its
                       tokens' sum) / (global count), so the gradients summed over ranks (FSDP,
                       divide factor 1) are the gradient of the global loss
    micro-batch count  maxed: FSDP gathers parameters on every forward, so all ranks run as many;
                       a rank with fewer runs extra zero-weight passes (Trainer)
    replicated grads   summed: parameters left out of FSDP (fp32 ones in low-precision units,
                       lockstep/dist/fsdp.py) are plain tensors on every rank
    grad-norm squares  summed over sharded gradients (each rank holds a disjoint shard); squares of
                       replicated gradients are counted once, on every rank
    metrics            loss terms summed (each already divided by the global count); per-sample
                       metrics computed on the gathered samples, in rank order (gather_tensors)

`DataParallel()` (no group) is one process: every method returns its input. The group is any
torch.distributed group of the data-parallel ranks (lockstep.dist builds it; the trainer imports
no launcher). Tensors travel on `device` (NCCL needs CUDA tensors, gloo takes CPU ones).
`collective(op)`, a context manager factory, wraps each call: lockstep.dist passes
`DistContext.collective`, which turns a timeout or a dead peer into an error naming the rank and op.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, ContextManager, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor


def moves_cuda_over_gloo(group: dist.ProcessGroup, device_type: str) -> bool:
    """CUDA tensors whose collectives gloo would run: ranks sharing a GPU (NCCL refuses that).
    DTensor's functional all-gather of such tensors crashed on torch 2.11 (SIGSEGV in wait_tensor),
    so FSDP's collectives and `gather_full` stage them through host memory (bitwise the same)."""
    return device_type == "cuda" and dist.get_backend(group) == "gloo"


_host_meshes: dict[int, DeviceMesh] = {}


def _host_mesh(mesh: DeviceMesh) -> DeviceMesh:
    # the same ranks and gloo group, as a CPU mesh: DTensor collectives then run on host tensors
    if mesh.ndim != 1:
        raise NotImplementedError(f"gathering a DTensor of a {mesh.ndim}-D mesh through host memory")
    group = mesh.get_group()
    if id(group) not in _host_meshes:
        _host_meshes[id(group)] = DeviceMesh.from_group(group, "cpu", mesh_dim_names=mesh.mesh_dim_names)
    return _host_meshes[id(group)]


def gather_full(t: DTensor, host_staged: bool | None = None) -> torch.Tensor:
    """`t.full_tensor()` (a collective), staged through host memory where gloo carries CUDA tensors
    (`host_staged` None) or when asked."""
    mesh = t.device_mesh
    if not (host_staged if host_staged is not None else moves_cuda_over_gloo(mesh.get_group(), mesh.device_type)):
        return t.full_tensor()
    host = DTensor.from_local(t.to_local().cpu(), _host_mesh(mesh), t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())
    return host.full_tensor().to(t.device)


def drain(gathers: Iterable) -> None:
    """Run an iterator of gathered tensors (e.g. named_weights on a rank that keeps nothing) for its
    collectives alone, holding no item: a `for` loop's variable would keep each tensor alive while the
    next is gathered."""
    collections.deque(gathers, maxlen=0)


def full_tensor(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t`, a local shard laid out as DTensor `like` is (same mesh, placements, global shape), gathered
    whole (a collective); `t` itself when `like` is a plain tensor."""
    if not isinstance(like, DTensor):
        return t
    return gather_full(DTensor.from_local(t, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                          stride=like.stride()))


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `full` as DTensor `like` holds its own (cut locally, no communication);
    `full` itself when `like` is a plain tensor."""
    if not isinstance(like, DTensor):
        return full
    full = full.to(like.device)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


class DataParallel:
    """Sums and gathers over the data-parallel group; the identity for one process."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 collective: Callable[[str], ContextManager] | None = None):
        self.group = group
        self.device = torch.device(device)
        self.collective = collective or (lambda op: contextlib.nullcontext())
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def _all_reduce(self, t: torch.Tensor, op, what: str) -> torch.Tensor:
        if self.enabled:
            with self.collective(f"data-parallel all_reduce ({what})"):
                dist.all_reduce(t, op=op, group=self.group)
        return t

    def sum(self, t: torch.Tensor, what: str = "sum") -> torch.Tensor:
        """Elementwise sum over ranks (in place on `t`, which is returned)."""
        return self._all_reduce(t, dist.ReduceOp.SUM, what)

    def max_ints(self, values: list[int], what: str = "max") -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        return [int(v) for v in self._all_reduce(t, dist.ReduceOp.MAX, what).tolist()]

    def sum_floats(self, values: list[float], what: str = "sum") -> list[float]:
        # float64: counts stay exact integers whatever the rank count
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return [float(v) for v in self.sum(t, what).tolist()]

    def sum_tensors(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Scalar tensors summed over ranks, one collective; the dict's keys must agree on every rank."""
        if not self.enabled or not values:
            return values
        keys = sorted(values)
        flat = self.sum(torch.stack([values[k].detach().reshape(()).to(self.device) for k in keys]), "metrics")
        return dict(zip(keys, flat.unbind()))

    @torch.no_grad()
    def sum_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum `.grad` of replicated parameters over ranks (a parameter without one on every rank is
        skipped everywhere: autograd gives the same graph to every rank's forward)."""
        if not self.enabled:
            return
        for p in params:
            if p.grad is not None:
                self.sum(p.grad, "replicated gradients")

    def barrier(self, what: str) -> None:
        if self.enabled:
            with self.collective(f"data-parallel barrier ({what})"):
                dist.barrier(group=self.group)

    def gather_tensors(self, *lists: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
        """Every rank's `lists` of 1-D tensors (per-sample logprobs, masks), in rank order; list j's
        tensors come back in the dtype and on the device of this rank's list j.

        Sent as tensors, not pickled: each rank's count, its tensors' lengths, then every value as
        float64 (exact for fp32 / bf16 values and integer masks), each rank's part padded to the
        longest (all_gather wants one size). On 2 H200s, all_gather_object of a step's per-sample
        logprobs and masks took 42 ms of a 0.37 s train step, two tensor gathers 0.6 ms
        (benchmarks/fsdp_step.py, its tensor-gather column)."""
        if not self.enabled:
            return [tuple(list(x) for x in lists)]
        counts = [len(x) for x in lists]
        if len(set(counts)) != 1:
            raise ValueError(f"data-parallel rank {self.rank}: gather_tensors wants lists of one length, got {counts}")
        k = torch.tensor([counts[0]], dtype=torch.int64)
        ks = [int(x) for x in self._all_gather_padded(k, [1] * self.size, "sample counts")]
        lens = torch.tensor([t.numel() for x in lists for t in x], dtype=torch.int64)
        rank_lens = self._all_gather_padded(lens, [len(lists) * n for n in ks], "tensor lengths")
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64, copy=False).cpu() for x in lists for t in x])
        values = self._all_gather_padded(flat, [int(r.sum()) for r in rank_lens], "values")
        like = [(x[0].dtype, x[0].device) if x else (torch.float32, torch.device("cpu")) for x in lists]
        return [self._unflatten(v, r.tolist(), like) for v, r in zip(values, rank_lens)]

    def _all_gather_padded(self, t: torch.Tensor, sizes: list[int], what: str) -> list[torch.Tensor]:
        """Each rank's 1-D `t` (its length in `sizes`, rank order) -> every rank's, on the CPU."""
        pad = torch.zeros(max(max(sizes), 1), dtype=t.dtype, device=self.device)
        pad[:t.numel()] = t.to(self.device)
        out = [torch.empty_like(pad) for _ in sizes]
        with self.collective(f"data-parallel all_gather ({what})"):
            dist.all_gather(out, pad, group=self.group)
        return [o[:n].cpu() for o, n in zip(out, sizes)]

    @staticmethod
    def _unflatten(values: torch.Tensor, lens: list[int], like: list[tuple[torch.dtype, torch.device]]) -> tuple:
        parts, k = values.split(lens), len(lens) // len(like)
        return tuple([p.to(dtype).to(device) for p in parts[j * k:(j + 1) * k]] for j, (dtype, device) in enumerate(like))
