"""The trainer ranks as a pp x ep grid: pipelines side by side, each stage's experts sharded across them.

    grid = pipeline_grid(ctx, pp)       # every rank calls it, trainer or not, once, in the same order
    grid.stage, grid.pipeline           # this rank's place: stage s of pipeline p
    grid.pipeline_group                 # the pp ranks of this rank's pipeline (point-to-point activations)
    grid.ep_group                       # the ep ranks holding this rank's stage, one per pipeline

Layout (Megatron's order, pipeline outermost): trainer rank index i = s * ep + p. The ranks of one
stage are consecutive, so each stage's expert-parallel group (the heavy all-to-all every MoE layer
runs twice per micro-batch) lies within a node whenever ep divides the GPUs of a node, and the
pipelines are strided across the nodes (each stage boundary sends one [b, S, n, H] activation per
micro-batch, the light traffic). 4 trainer ranks, pp 2 x ep 2:

    pipelines  {0, 2}, {1, 3}        (stage 0 on ranks 0 and 1, stage 1 on ranks 2 and 3)
    ep groups  {0, 1}, {2, 3}

The ep group is also the data-parallel group of the stage: pipeline p trains block p of the batch,
so the replicated (non-expert) gradients are summed over it (lockstep/dist/pipeline_expert_parallel.py).
The first trainer rank is stage 0 of pipeline 0: the weight source and the checkpoint writer.

Groups are made with `groups._group` in a fixed order (every pipeline group, then every ep group),
by every rank of the world, member or not: torch's new_group is a collective over the default
group, and ranks making groups in different orders deadlock (THUDM/slime#2331).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from lockstep.dist.groups import DistContext, _group


@dataclass(frozen=True)
class PipelineGrid:
    """This rank's place in the pp x ep grid of trainer ranks (module docstring)."""

    pp: int
    ep: int
    stage: int
    pipeline: int
    pipeline_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup


def grid_ranks(trainer_ranks: tuple[int, ...], pp: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(the pipelines' ranks, stage order within each; each stage's ep ranks, pipeline order)."""
    if pp < 1 or len(trainer_ranks) % pp:
        raise ValueError(f"pipeline_model_parallel_size {pp}: the {len(trainer_ranks)} trainer ranks do not split "
                         "into whole pipelines (trainer ranks = pipeline x expert parallel size)")
    ep = len(trainer_ranks) // pp
    pipelines = [tuple(trainer_ranks[s * ep + p] for s in range(pp)) for p in range(ep)]
    stages = [tuple(trainer_ranks[s * ep:(s + 1) * ep]) for s in range(pp)]
    return pipelines, stages


def pipeline_grid(ctx: DistContext, pp: int) -> PipelineGrid | None:
    """Make the grid's groups (every rank of the world calls this, in the same place); this rank's
    PipelineGrid, None on a rank that does not train."""
    pipelines, stages = grid_ranks(ctx.layout.trainer_ranks, pp)
    timeout = datetime.timedelta(seconds=ctx.timeout_s)
    with ctx.collective(f"new_group (the {len(pipelines)} pipelines, the {pp} stages' expert-parallel groups)"):
        pipeline_groups = [_group(ranks, timeout, None) for ranks in pipelines]
        ep_groups = [_group(ranks, timeout, None) for ranks in stages]
    if not ctx.is_trainer:
        return None
    stage, pipeline = divmod(ctx.layout.trainer_ranks.index(ctx.rank), len(pipelines))
    return PipelineGrid(pp=pp, ep=len(pipelines), stage=stage, pipeline=pipeline,
                        pipeline_group=pipeline_groups[pipeline], ep_group=ep_groups[stage])
