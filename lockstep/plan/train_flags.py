"""The `lockstep train` flags that realise a planned layout, or why lockstep cannot run it yet.

Only flags `lockstep train` has: the planner's actor / rollout nodes become a disaggregated world
(--nnodes, --nproc-per-node, --actor-num-gpus, --rollout-num-gpus), EP becomes
--expert-model-parallel-size (lockstep's EP spans every trainer rank: EP = DP), and the training
spec gives --max-tokens-per-gpu, --recompute-activations and --optimizer-offload. TP > 1, CP > 1,
PP (colocated only in lockstep, the planner's layout is disaggregated), EP smaller than the trainer
ranks and optimizer offload with EP have no lockstep implementation: `not_runnable` names them.
--model, --node-rank and --master-addr are the user's, per run and per node.
"""

from __future__ import annotations

from lockstep.plan.cluster import ClusterSpec, TrainSpec
from lockstep.plan.layout import Layout


def train_flags(layout: Layout, cluster: ClusterSpec, train: TrainSpec) -> tuple[list[str] | None, str]:
    """(flags, "") when `lockstep train` can run `layout`, else (None, why not)."""
    why = []
    if layout.tp > 1:
        why.append(f"TP {layout.tp}: lockstep has no tensor parallel")
    if layout.cp > 1:
        why.append(f"CP {layout.cp}: lockstep has no context parallel")
    if layout.pp > 1:
        why.append(f"PP {layout.pp}: lockstep's pipeline runs colocated with PP = every rank (no data parallel, "
                   "no EP), the plan is disaggregated")
    if layout.ep > 1 and layout.ep != cluster.actor_gpus:
        why.append(f"EP {layout.ep} < the {cluster.actor_gpus} trainer ranks: lockstep's EP spans every trainer rank")
    if layout.ep > 1 and train.optimizer_offload:
        why.append("optimizer offload with EP > 1: the expert-parallel trainer does not offload")
    if not train.distributed_optimizer:
        why.append("an unsharded optimizer: lockstep's trainer always shards it")
    if why:
        return None, "; ".join(why)
    flags = ["--nnodes", str(cluster.actor_nodes + cluster.rollout_nodes),
             "--nproc-per-node", str(cluster.gpus_per_node),
             "--actor-num-gpus", str(cluster.actor_gpus), "--rollout-num-gpus", str(cluster.rollout_gpus),
             "--max-tokens-per-gpu", str(train.max_tokens_per_gpu)]
    if layout.ep > 1:
        flags += ["--expert-model-parallel-size", str(layout.ep)]
    if train.recompute:
        flags.append("--recompute-activations")
    if train.optimizer_offload:
        flags.append("--optimizer-offload")
    return flags, ""
