"""Evaluate layouts and rank them: memory decides feasibility, estimated step time the order.

Estimated step seconds = compute * (1 + pipeline bubble) + every communication term + weight push,
with no overlap between them (an upper bound; real systems hide part of TP / EP / DP traffic).
Infeasible layouts sort after feasible ones, least over-budget first, each with the reason:
which side (actor stage, host, rollout) breaks, by how much, and its largest memory term.
Colocated (ClusterSpec.colocate), every GPU holds its actor stage's terms and its engine's
(`colocated_stage`), so the stages carry the rollout side and no rollout GPU is checked apart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lockstep.plan.cluster import GB, ClusterSpec, RolloutSpec, TrainSpec
from lockstep.plan.comm import CommTerm, step_comm
from lockstep.plan.compute import compute_seconds
from lockstep.plan.layout import Layout, enumerate_layouts
from lockstep.plan.memory import StageMemory, actor_memory, stage_layer_indices, worst_stage
from lockstep.plan.model import ModelSpec
from lockstep.plan.rollout import RolloutMemory, rollout_memory


@dataclass(frozen=True)
class LayoutPlan:
    layout: Layout
    stages: tuple[StageMemory, ...]
    rollout: RolloutMemory
    comm: tuple[CommTerm, ...]
    compute_s: float
    bubble: float
    usable_bytes: float
    host_bytes_per_node: float
    reason: str

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def worst(self) -> StageMemory:
        return worst_stage(list(self.stages))

    @property
    def actor_bytes(self) -> float:
        return self.worst.gpu_bytes

    @property
    def step_seconds(self) -> float:
        return self.compute_s * (1 + self.bubble) + sum(c.seconds for c in self.comm)

    @property
    def overflow(self) -> float:
        """How far the tighter side is over (>0) or under (<0) the usable memory, in bytes."""
        return max(self.actor_bytes, self.rollout.gpu_bytes) - self.usable_bytes

    def comm_term(self, name: str) -> CommTerm:
        return next(c for c in self.comm if c.name == name)


def colocated_stage(stage: StageMemory, engine: RolloutMemory) -> StageMemory:
    """A colocated GPU: its actor stage's terms and its engine's ("engine: ..."); the engine's
    phases (generation, weight update) never meet the train step's (memory.py)."""
    return replace(stage, terms=stage.terms + tuple(replace(t, name=f"engine: {t.name}") for t in engine.terms))


def _reason(worst: StageMemory, rollout: RolloutMemory, usable: float, host_node: float,
            cluster: ClusterSpec) -> str:
    reasons = []
    if worst.gpu_bytes > usable:
        big = worst.largest()
        reasons.append(f"actor stage {worst.stage}: {worst.gpu_bytes / GB:.1f} GB > {usable / GB:.1f} GB usable "
                       f"({big.name} {big.bytes / GB:.1f} GB)")
    if cluster.host_memory_gb is not None and host_node > cluster.host_memory_gb * GB:
        reasons.append(f"host: {host_node / GB:.0f} > {cluster.host_memory_gb:.0f} GB per node")
    if rollout.gpu_bytes > usable and not cluster.colocate:  # colocated: counted in the stages
        big = rollout.largest()
        reasons.append(f"rollout: {rollout.gpu_bytes / GB:.1f} GB > {usable / GB:.1f} GB usable "
                       f"({big.name} {big.bytes / GB:.1f} GB)")
    return "; ".join(reasons)


def evaluate(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, rollout: RolloutSpec,
             layout: Layout, rollout_mem: RolloutMemory | None = None) -> LayoutPlan:
    """Memory, communication and compute of one layout."""
    stages = actor_memory(model, cluster, train, layout)
    ranges = stage_layer_indices(model, layout, train.decoder_last_pipeline_num_layers)
    rmem = rollout_mem or rollout_memory(model, cluster, rollout, train.seq_len)
    if cluster.colocate:
        stages = [colocated_stage(s, rmem) for s in stages]
    comm = step_comm(model, cluster, train, rollout, layout, ranges)
    compute, bubble = compute_seconds(model, cluster, train, layout, ranges)
    host_node = max(s.host_bytes for s in stages) * cluster.gpus_per_node
    usable = cluster.usable_bytes
    reason = _reason(worst_stage(stages), rmem, usable, host_node, cluster)
    return LayoutPlan(layout=layout, stages=tuple(stages), rollout=rmem, comm=tuple(comm), compute_s=compute,
                      bubble=bubble, usable_bytes=usable, host_bytes_per_node=host_node, reason=reason)


def rank(plans: list[LayoutPlan]) -> list[LayoutPlan]:
    """Feasible first by estimated step seconds; then infeasible, least over budget first."""
    return sorted(plans, key=lambda p: (not p.feasible, p.step_seconds if p.feasible else p.overflow))


def plan(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, rollout: RolloutSpec, *, tp=None, pp=None,
         ep=None, cp=None) -> list[LayoutPlan]:
    """Evaluate every valid layout (restricted by any fixed dimension) and rank them."""
    rmem = rollout_memory(model, cluster, rollout, train.seq_len)
    layouts = enumerate_layouts(model, cluster, train, tp=tp, pp=pp, ep=ep, cp=cp)
    return rank([evaluate(model, cluster, train, rollout, lay, rmem) for lay in layouts])
