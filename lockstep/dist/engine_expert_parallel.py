"""Expert parallelism for the rollout engine, with data-parallel attention (DISTRIBUTED.md, "Engine
parallelism" item 2): how a model whose routed experts do not fit one device is served.

    engine = expert_parallel_engine(ctx, model, EngineConfig(...), tokenizer)   # on every engine rank
    samples = engine.generate(my_requests)          # each rank its own requests, all ranks together
    engine.update_weights(full_named_tensors, version)       # each rank keeps its experts' slice

Each engine rank keeps what one Engine keeps -- attention, KV caches, scheduler, requests -- except
the routed experts: rank r of ep keeps experts [r E/ep, (r+1) E/ep) of every MoE layer, as plain
tensors (`EngineExpertShard`). From a checkpoint (`expert_parallel_engine_from_pretrained`, what
`lockstep train --rollout-expert-parallel-size` builds) the rank reads only those experts into host
memory (`load_pretrained(..., experts=window)`: per-expert tensors of other experts are never read,
stacked ones are read through `get_slice` rows), so neither host nor device ever holds every expert;
a model handed over whole (`expert_parallel_engine`) has the other experts dropped before the engine
moves it to its device. The router, hash table, router bias and shared expert stay replicated, so
routing is what one engine computes.

The expert exchange is the trainer's (`ExpertParallelExperts.sorted_mlp`, expert_parallel.py, one
home): token counts exchanged first, rows all-to-all to their experts' ranks, the local experts'
grouped MLP run once per SOURCE rank, outputs all-to-all back, the k outputs summed on the home rank
in ascending expert order; a source's rows take the MLP kernel of the source's own step kind (decode
or prefill, exchanged with the counts). A source's rows for an expert are exactly the rows one engine serving
that rank's requests has for it, computed in a GEMM of their own, so a rank's samples are bitwise
what one engine generates for the same requests (tests/dist/test_engine_expert_parallel.py, fp32
and bf16, no batch-invariant mode needed). DISTRIBUTED.md suggests all-gather + reduce-scatter
instead (fixed shapes suit CUDA graphs); that sums a token's expert outputs across ranks in
whatever order the reduce-scatter takes, so not bitwise one engine. Hence, with this exchange,
CUDA graphs and multi-step decode windows (whose shapes and host round trips assume one process)
are turned off for the EP engine, with a line on stderr when they were asked for on CUDA.

Lockstep steps: the exchanges are collectives, so every rank runs every forward call together.
Before a step's forward calls each rank says how many it needs (`runner.group_calls`: decode
batch, prefill groups, or one per sequence in batch-invariant mode) and a MAX all-reduce over the
gloo control group gives the step's count; a rank with fewer runs empty forwards for the rest:
every MoE layer's exchange with zero rows, in layer order, no attention, no sampling. A rank whose
requests are done keeps taking part in steps (empty ones) until the all-reduce says no rank
scheduled anything: `generate` returns only when every rank is done. A dead peer fails the
survivor's next collective: `DistributedError` naming rank and operation (groups.collective). A rank
whose step fails after its forwards (sampling, stop checks) says so at the next agreement, and its
peers raise `DistributedError` naming it; one failing inside a forward leaves its peers in an
exchange until the timeout.

Scope: the colocated layout (every rank serves; EP = the engine ranks = the world, so the control
group is the engine group). Weight push: full expert tensors in (in-process, or `push_weights`,
whose staging keeps each rank's slice through `local_tensors`); the manifest is the full model's.
Not built: EP smaller than the engine ranks, the disaggregated layout, the background loop / HTTP
server, `update_weights_from_disk`, CUDA graphs (the all-gather form), a windowed load of the
trainer's experts (its policy is still loaded whole, then sharded). Not yet run on GPUs (NCCL),
so bitwise equality with one engine there, where decode rows take the Triton kernels, is not shown.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch import nn

from lockstep.config import EngineConfig
from lockstep.dist.expert_parallel import (ExpertParallelExperts, apply_expert_parallel, checkpoint_expert_window,
                                          ep_mesh)
from lockstep.dist.groups import DistContext, DistributedError
from lockstep.engine.engine import Engine
from lockstep.engine.runner import group_calls


class EngineExpertShard(ExpertParallelExperts):
    """The trainer's exchange over a plain [E/ep, ...] tensor shard: the engine's casts, serving-format
    quantisation and weight updates see an ordinary parameter (quantisation blocks never cross
    experts, so a slice is served as the same experts are in one engine)."""

    def _shard(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        return nn.Parameter(local, requires_grad=False)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj, self.down_proj

    @property
    def first_expert(self) -> int:
        return self.rows.start


def _serving_config(config: EngineConfig) -> EngineConfig:
    """CUDA graphs and decode windows off (module docstring), said once when they were asked for; the
    true-on-policy forward off where it was left to the default, an error where it was asked for."""
    if config.true_on_policy is None:
        config = dataclasses.replace(config, true_on_policy=False)
    if config.true_on_policy:
        raise ValueError("rollout_expert_parallel_size > 1 with true_on_policy: the true-on-policy forward "
                         "computes every routed expert on each rank (dense, models/deepseek_v4_rows.py); the "
                         "expert-parallel engine holds a shard of them")
    on_cuda = torch.device(config.device).type == "cuda"
    if on_cuda and (config.cuda_graph or config.decode_steps > 1):
        print("lockstep engine: expert parallel: CUDA graphs and multi-step decode windows are off (the "
              "all-to-all exchange has per-step shapes and every step is agreed with the peers)", file=sys.stderr)
    return dataclasses.replace(config, cuda_graph=False, decode_steps=1)


def _check_layout(ctx: DistContext, ep_size: int | None) -> int:
    """The number of engine ranks (= EP); `ep_size`, when given (the run's flag), must equal it."""
    engines = len(ctx.layout.engine_ranks)
    if ep_size is not None and ep_size != engines:
        raise ValueError(f"rank {ctx.rank}: rollout_expert_parallel_size {ep_size} must equal the engine ranks, "
                         f"here {engines} (EP smaller than the engine ranks is not built)")
    if not ctx.layout.is_colocated:
        raise ValueError(f"rank {ctx.rank}: the expert-parallel engine runs in the colocated layout only "
                         "(every rank trains and serves); with --actor-num-gpus / --rollout-num-gpus it is not built")
    return engines


def expert_parallel_engine(ctx: DistContext, model: nn.Module, config: EngineConfig, tokenizer=None,
                           ep_size: int | None = None):
    """This rank's ExpertParallelEngine over every engine rank, from a model on the host holding every
    expert (the ones this rank does not keep are dropped before the Engine moves the model to its
    device) or only this rank's (`expert_parallel_engine_from_pretrained`).
    `ep_size`, when given (the run's flag), must be the number of engine ranks."""
    engines = _check_layout(ctx, ep_size)
    apply_expert_parallel(model, ep_mesh(ctx.engine_group, ctx.device.type), ctx.collective, EngineExpertShard)
    engine = ExpertParallelEngine(ctx, Engine(model, _serving_config(config), tokenizer))
    shard = engine.experts[0]
    print(f"lockstep engine: rank {ctx.rank}: expert parallel over {engines} ranks, experts "
          f"[{shard.first_expert}, {shard.first_expert + shard.n_local}) of {shard.n_experts} in each of "
          f"{len(engine.experts)} MoE layers", file=sys.stderr)
    return engine


def expert_parallel_engine_from_pretrained(ctx: DistContext, path, config: EngineConfig, ep_size: int | None = None):
    """The same from a checkpoint directory, reading only this rank's experts into host memory."""
    from lockstep.models import load_pretrained
    from lockstep.models.tokenizer import has_tokenizer, load_tokenizer

    engines = _check_layout(ctx, ep_size)
    # the mesh's rank order: the engine group's, i.e. the engine ranks' order
    window = checkpoint_expert_window(path, engines, ctx.layout.engine_ranks.index(ctx.rank),
                                      "rollout_expert_parallel_size")
    model = load_pretrained(path, dtype=getattr(torch, config.dtype), device="cpu", experts=window)
    return expert_parallel_engine(ctx, model, config, load_tokenizer(path) if has_tokenizer(path) else None, ep_size)


class _AgreedRunner:
    """The engine's ModelRunner, its forward calls agreed with the peers (module docstring)."""

    def __init__(self, runner, engine: "ExpertParallelEngine"):
        self.runner, self.ep = runner, engine

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, scheduled):
        mine = len(group_calls(scheduled, self.runner.batch_invariant, self.runner.one_call))
        step = self.ep.agree_step(mine)
        self.ep.in_forward = True  # a failure in here leaves the peers inside an exchange
        out = self.runner.execute(scheduled)
        self.ep.empty_forwards(step - mine)
        self.ep.in_forward = False
        return out


class ExpertParallelEngine:
    """One engine rank of the expert-parallel engine: the Engine seam (generate, update_weights,
    update_targets, weight_version, pause / resume, tokenizer, model) over this rank's Engine."""

    def __init__(self, ctx: DistContext, engine: Engine):
        self.ctx, self.engine = ctx, engine
        # module order is forward order: an empty forward's exchanges meet the peers' real ones layer by layer
        self.experts = [m for m in engine.model.modules() if isinstance(m, EngineExpertShard)]
        if not self.experts:
            raise ValueError(f"rank {ctx.rank}: the engine's model has no expert-parallel experts")
        self._expert_names = {f"{name}.{p}": m for name, m in engine.model.named_modules()
                              if isinstance(m, EngineExpertShard) for p in ("gate_up_proj", "down_proj")}
        self.steps = self.empty_forward_calls = 0  # agreed steps; forwards run with no rows (the log, tests)
        self.in_forward = False
        engine.runner = _AgreedRunner(engine.runner, self)

    # ---- the seam -------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def paused(self) -> bool:
        return self.engine.paused

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def generate(self, requests: list) -> list:
        """This rank's samples for its own `requests` (possibly none); returns once every rank is done."""
        try:
            samples = self.engine.generate(requests)  # its steps are agreed through _AgreedRunner
        except DistributedError:
            raise
        except Exception:
            self._announce_failure()
            raise
        while (step := self.agree_step(0)) > 0:
            self.empty_forwards(step)
        return samples

    def _announce_failure(self) -> None:
        """This rank failed between steps (sampling, stop checks): its peers wait at the next step's
        agreement, so tell them there -- they stop at once, naming this rank, instead of at the
        timeout. A failure inside a forward leaves them in an exchange: nothing to meet them with."""
        if self.in_forward:
            return
        try:
            self.agree_step(0, failed=True)
        except DistributedError:
            pass  # a peer is gone too; this rank's own error is the one to raise

    def update_targets(self):
        return self.engine.update_targets()

    def update_weights(self, named_tensors, version: int, partial: bool = False) -> None:
        """Full expert tensors are cut to this rank's experts; the Engine validates and writes. The
        slices are copies: a colocated update's tensors come one at a time from a gather (FSDP's, the
        pipeline's broadcasts), and a view would keep each full expert tensor alive until the write,
        i.e. every expert of the model on every rank at once, what expert parallelism is for avoiding."""
        self.engine.update_weights(self.local_tensors(named_tensors, copy=True), version, partial)

    def local_tensors(self, named_tensors, copy: bool = False) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs with each full routed-expert tensor [E, ...] replaced by this rank's
        slice (a view, or with `copy` a tensor of its own); other tensors, and slices already cut,
        pass as they are."""
        pairs = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        out = []
        for name, t in pairs:
            m = self._expert_names.get(name)
            if m is not None and isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == m.n_experts:
                t = t[m.first_expert:m.first_expert + m.n_local]
                t = t.clone() if copy else t
            out.append((name, t))
        return out

    # ---- lockstep steps -------------------------------------------------------------------

    def agree_step(self, forwards: int, failed: bool = False) -> int:
        """The most forward calls any rank needs this step (0: every rank is done); raises when a peer
        says it failed (`_announce_failure`)."""
        self.steps += 1
        op = f"all_reduce MAX of forward calls (expert-parallel engine step {self.steps})"
        t = torch.tensor([forwards, self.ctx.rank + 1 if failed else 0], dtype=torch.int64)
        with self.ctx.collective(op):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctx.control_group)
        most, failed_rank = t.tolist()
        if failed_rank and not failed:
            raise DistributedError(f"rank {self.ctx.rank}: {op}: rank {failed_rank - 1} failed (its own error "
                                   "says why); this rank stops too")
        return most

    @torch.no_grad()
    def empty_forwards(self, n: int) -> None:
        """n forwards with no rows: every MoE layer's exchange, so the peers' real ones complete."""
        self.empty_forward_calls += n
        for _ in range(n):
            for experts in self.experts:
                w = experts.gate_up_proj
                rows = torch.empty(0, w.shape[-1], dtype=w.dtype, device=w.device)
                experts.sorted_mlp(rows, torch.zeros(experts.n_experts, dtype=torch.long, device=w.device))
