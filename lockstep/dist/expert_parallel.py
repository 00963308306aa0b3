"""Expert parallelism for the trainer, applied to the one model from outside (DESIGN principle 3).

    mesh = ep_mesh(trainer_group, "cpu")                    # EP = the trainer's data-parallel ranks
    apply_expert_parallel(model, mesh, collective=ctx.collective)
    # or, from the run's settings: shard_experts(model, train_config.expert_model_parallel_size, ctx)
    trainer = Trainer(model, config, data_parallel=DataParallel(trainer_group, collective=ctx.collective))

Each MoE layer's routed experts (`MoE.experts`) are replaced by `ExpertParallelExperts`: rank r of an
ep-rank mesh keeps experts [r E/ep, (r+1) E/ep) as the local shard of a DTensor sharded on dim 0
(`Shard(0)`), the same stacked layout `Experts` holds, cut in contiguous expert blocks. The router,
`tid2eid`, the router bias and the shared expert stay replicated, so routing (and routing replay,
which forces the router's choice before the experts are called) is what one process computes.

Forward, per layer (inherited from `Experts`: dispatch order, combine; replaced: `sorted_mlp`):

    order, counts = dispatch_order(experts)    this rank's slots sorted by expert (all E), stably
    counts exchanged (all_to_all_single)       recv [ep, E_local]: rows each source sends per local expert,
                                               with each source's step kind (decode or not: its MLP kernel)
    rows dispatched (all_to_all_single_autograd): sorted by expert = grouped by destination rank
    per source block: the local experts' grouped SwiGLU MLP on that source's rows
    outputs returned (all_to_all_single_autograd), back in the dispatch order
    combine on the home rank: k expert outputs added in ascending expert order (Experts.forward)

Why the local MLP runs once per source rank, not once over all received rows: the rows a source
sends for expert e are exactly the rows a single process's micro-batch of that rank's samples has
for e, in the same order. Computed in a GEMM of their own, every row's output and every expert's
weight gradient (one GEMM per source, the sources' contributions then summed by autograd) are those
of one process accumulating the ranks' micro-batches one after the other: EP=2 is bitwise EP=1
(tests/dist/test_expert_parallel.py, fp32 and bf16). One GEMM over all received rows (sorted by
expert, sources interleaved) was tried and is not bitwise: even the logprobs differ, since a CPU
GEMM row's result depends on how many rows the GEMM has, and the weight gradient's token reduction
would be split differently. The cost is ep grouped-GEMM launches per layer instead of one.

Data parallelism: EP is carved out of the data-parallel ranks (Megatron, TorchTitan): the ep ranks
each train their own samples. The non-expert parameters are replicated and their gradients summed
over the same group (`DataParallel.sum_grads`, which sums every plain-tensor gradient); the expert
parameters are DTensors, so the Trainer and `MasterAdamW` already treat them as shards: no gradient
all-reduce (each rank's expert gradient is already the sum over every rank's tokens, brought back by
the all-to-all's backward), AdamW on the local shard, gradient-norm squares summed over ranks for
sharded gradients and counted once for replicated ones (optimizer.py), `named_weights` and
checkpoints gathering the full expert tensors. This needs the ep group to be the trainer's
data-parallel group (ep == the number of trainer ranks; with pipeline parallel, the ranks holding one
stage in every pipeline: pipeline_expert_parallel.py); EP smaller than DP (experts replicated or
FSDP-sharded over the remaining dp ranks) is not built.

The engine's expert parallelism (lockstep/dist/engine_expert_parallel.py) reuses this exchange
(`sorted_mlp`) with plain-tensor shards: one home for the dispatch, per-source GEMMs and combine.

A rank that receives no rows still runs both all-to-alls' backward (its empty output stays in the
autograd graph) and gets a zero expert gradient, as one process's stacked experts do.

The split sizes are read on the host (all_to_all_single takes python lists): one device sync per
layer on GPUs, as in TorchTitan's token dispatch. The quantisation-aware forward's fake quantisation
of the experts runs on the local slices (`_local`), in fp32 and bf16 runs alike (tested: fp32, bf16,
fp8-fp4 QAT, routing replay). Not combined here (TrainConfig refuses it): compiled layers. Not
built: FSDP over the same model (experts sharded over the remaining dp ranks with a nested
`fully_shard(experts, mesh=edp_mesh)`) and EP < DP. Not yet run
on GPUs (NCCL).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils import parametrize

from lockstep.dist.groups import DistContext
from lockstep.models.layers.moe import Experts, MoE

Collective = Callable[[str], ContextManager]


def ep_mesh(group: ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1-D expert-parallel mesh over an existing process group (e.g. the trainer group)."""
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("ep",))


def _sharded(local: torch.Tensor, mesh: DeviceMesh, n_experts: int, requires_grad: bool) -> nn.Parameter:
    """This rank's contiguous block of experts (dim 0, contiguous) of the n_experts, as a Shard(0)
    DTensor parameter."""
    shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(n_experts, *local.shape[1:]),
                               stride=local.stride())
    return nn.Parameter(shard, requires_grad=requires_grad)


class ExpertParallelExperts(Experts):
    """`Experts` with this rank's block of experts; rows travel to their experts' ranks and back."""

    def __init__(self, experts: Experts, mesh: DeviceMesh, collective: Collective | None = None):
        nn.Module.__init__(self)
        if experts.n_experts % mesh.size():
            raise ValueError(f"expert parallel: {experts.n_experts} experts do not split over "
                             f"{mesh.size()} ranks")
        self.n_experts, self.limit, self.kernels = experts.n_experts, experts.limit, experts.kernels
        self.mesh, self.group = mesh, mesh.get_group()
        self.ep_size, self.n_local = mesh.size(), experts.n_experts // mesh.size()
        self.rows = range(mesh.get_local_rank() * self.n_local, (mesh.get_local_rank() + 1) * self.n_local)
        self.collective = collective or (lambda op: contextlib.nullcontext())
        for attr in ("gate_up_proj", "down_proj"):
            w = getattr(experts, attr)
            setattr(self, attr, self._shard(self._block(w, experts.rows, attr), w.requires_grad))

    def _block(self, w: torch.Tensor, held: range, attr: str) -> torch.Tensor:
        """This rank's experts of `w`, which holds experts `held`: all of them (cut and cloned: a view
        would keep every expert's storage alive), or exactly this rank's (a windowed load,
        lockstep/models/checkpoint.py: kept as is)."""
        if held == range(self.n_experts):
            return w.detach()[self.rows.start:self.rows.stop].clone()
        if held == self.rows:
            return w.detach()
        raise ValueError(f"expert parallel: {attr} holds experts [{held.start}, {held.stop}), but rank "
                         f"{self.mesh.get_local_rank()} of {self.ep_size} serves [{self.rows.start}, {self.rows.stop}) "
                         f"of {self.n_experts}: load that window, or every expert")

    def _shard(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """This rank's block of a stacked expert weight, as the parameter it keeps (the engine's
        subclass, lockstep/dist/engine_expert_parallel.py, keeps a plain tensor instead)."""
        return _sharded(local, self.mesh, self.n_experts, requires_grad)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._local("gate_up_proj"), self._local("down_proj")

    def folds_shared(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        return False  # the rows go to other ranks; the shared expert's stay here

    def _local(self, name: str) -> torch.Tensor:
        """This rank's slice of expert weight `name`, a plain tensor (to_local's backward hands the
        gradient back as a Shard(0) DTensor). A quantisation-aware forward (train/quant_aware.py)
        parametrises the DTensor; its fake quantisation runs here on the local slice instead: its
        blocks never cross experts, so a slice quantises as the same experts do in one process."""
        if not parametrize.is_parametrized(self, name):
            return getattr(self, name).to_local()
        chain = self.parametrizations[name]
        w = chain.original.to_local()
        for f in chain:
            w = f(w)
        return w

    def sorted_mlp(self, xs: torch.Tensor, counts: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """Rows sorted by expert (counts [E]) -> their experts' outputs, same order (module docstring)."""
        received_counts, recv, decodes = self._exchange_counts(counts, decode)
        send = counts.view(self.ep_size, self.n_local).sum(1).tolist()
        received = self._all_to_all(xs, recv, send, "dispatch")
        # an empty block's output is itself: it keeps the combine's all-to-all in this rank's backward
        # (a rank that skips a collective there would leave its peers waiting)
        ys = torch.cat([self.mlp(rows, c, d) if rows.shape[0] else rows
                        for rows, c, d in zip(received.split(recv), received_counts, decodes)])
        if not ys.shape[0] and torch.is_grad_enabled():
            ys = ys + self._zero_dependence()
        return self._all_to_all(ys, send, recv, "combine")

    def _zero_dependence(self) -> torch.Tensor:
        """0 tied to the local expert weights: a rank whose experts got no rows still gets (zero)
        expert gradients, as the stacked experts of one process do whenever any expert had a row."""
        gate_up, down = self.expert_weights()
        return 0 * (gate_up.sum() + down.sum())

    def _exchange_counts(self, counts: torch.Tensor, decode: bool) -> tuple[torch.Tensor, list[int], list[bool]]:
        """counts [E] of this rank's rows, and its step kind -> ([ep, E_local]: rows each source rank sends
        to each local expert, rows from each source, each source's step kind). A source's rows take the MLP
        kernel its own step would (`Experts.mlp`'s decode path): in the engine (engine_expert_parallel.py)
        ranks decode and prefill in the same step, and the kernel decides the rounding."""
        kind = counts.new_full((self.ep_size, 1), int(decode))
        send = torch.cat([counts.view(self.ep_size, self.n_local), kind], 1)  # one block of E_local + 1 per rank
        received = torch.empty_like(send)
        with self.collective("expert-parallel all_to_all (token counts)"):
            dist.all_to_all_single(received, send, group=self.group)
        received_counts = received[:, :-1].contiguous()
        host = torch.cat([received_counts.sum(1), received[:, -1]]).tolist()  # one read back
        return received_counts, host[:self.ep_size], [bool(d) for d in host[self.ep_size:]]

    def _all_to_all(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], what: str) -> torch.Tensor:
        with self.collective(f"expert-parallel all_to_all ({what})"):
            out = all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, self.group)
            # the functional collective is asynchronous: wait here, so a failure names this operation
            return (out + 0).view(-1, rows.shape[-1])  # +0 waits, an empty output included

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, local={self.n_local}, ep={self.ep_size}"


def expert_window(n_experts: int, ep_size: int, ep_rank: int, flag: str = "expert_model_parallel_size") -> range:
    """The routed experts rank `ep_rank` of `ep_size` holds: its contiguous block (the order
    `ExpertParallelExperts` shards in). `flag`: the setting named when the experts do not split."""
    if n_experts % ep_size:
        raise ValueError(f"n_routed_experts {n_experts} (config.json) does not split over {flag} {ep_size}")
    n_local = n_experts // ep_size
    return range(ep_rank * n_local, (ep_rank + 1) * n_local)


def checkpoint_expert_window(path, ep_size: int, ep_rank: int, flag: str = "expert_model_parallel_size") -> range:
    """`expert_window` of the MoE model in checkpoint directory `path` (its config.json's
    n_routed_experts): what a rank reads of it (load_pretrained's / load_stage's `experts`)."""
    from lockstep.models.registry import config_from_file

    n_experts = getattr(config_from_file(Path(path) / "config.json"), "n_routed_experts", None)
    if not n_experts:
        raise ValueError(f"{path}: config.json names no n_routed_experts: expert parallelism needs a MoE model")
    return expert_window(n_experts, ep_size, ep_rank, flag)


def load_expert_parallel(path, ep_size: int, ctx: DistContext, dtype: torch.dtype) -> nn.Module:
    """`shard_experts` of the checkpoint in `path`, reading only this rank's block of the routed experts
    (`load_pretrained(..., experts=window)`): no trainer rank holds every expert, even on the host,
    as a model whose experts fit only across the ranks needs."""
    from lockstep.models import load_pretrained

    _check_trainer_ranks(ep_size, ctx)
    # the mesh's rank order (ep_mesh): the trainer group's
    window = checkpoint_expert_window(path, ep_size, dist.get_group_rank(ctx.trainer_group, ctx.rank))
    return shard_experts(load_pretrained(path, dtype=dtype, device=ctx.device, experts=window), ep_size, ctx)


def _check_trainer_ranks(ep_size: int, ctx: DistContext) -> None:
    trainers = len(ctx.layout.trainer_ranks)
    if trainers != ep_size:
        raise ValueError(f"expert_model_parallel_size {ep_size}: the experts are sharded over the trainer "
                         f"ranks, which are {trainers} (EP smaller than data parallel is not built)")


def shard_experts(model: nn.Module, ep_size: int, ctx: DistContext) -> nn.Module:
    """`TrainConfig.expert_model_parallel_size` applied: EP over the trainer group (which must have
    ep_size ranks), collectives named through `ctx.collective`; ep_size 1 leaves the model alone."""
    if ep_size == 1:
        return model
    _check_trainer_ranks(ep_size, ctx)
    return apply_expert_parallel(model, ep_mesh(ctx.trainer_group, ctx.device.type), ctx.collective)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, collective: Collective | None = None,
                          experts_class: type[ExpertParallelExperts] = ExpertParallelExperts) -> nn.Module:
    """Shard the routed experts of every MoE layer of `model` (in place) over `mesh`'s ranks; every
    rank must hold the same full weights before (e.g. loaded from one checkpoint). Returns the model.
    `experts_class`: the engine passes its plain-tensor shard (engine_expert_parallel.py)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"expert parallel: {type(model).__name__} has no MoE layers")
    for moe in layers:
        moe.experts = experts_class(moe.experts, mesh, collective)
    return model
