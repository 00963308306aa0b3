"""The `lockstep train` flags that realise a planned layout, or why lockstep cannot run it yet.

Only flags `lockstep train` has: the planner's actor / rollout nodes become a disaggregated world
(--nnodes, --nproc-per-node, --actor-num-gpus, --rollout-num-gpus), EP becomes
--expert-model-parallel-size (lockstep's EP spans every trainer rank: EP = DP), and the training
spec gives --max-tokens-per-gpu, --recompute-activations and --optimizer-offload. TP > 1, CP > 1,
PP (colocated only in lockstep, the planner's layout is disaggregated) and EP smaller than the
trainer ranks have no lockstep implementation: `not_runnable` names them. Optimizer offload runs
with every trainer (FSDP's CPUOffloadPolicy; MasterAdamW's offload under EP and PP: the PP 2 x EP 2
run with recompute and offload logs the one-process run's metrics, tests/dist).
--model, --node-rank and --master-addr are the user's, per run and per node. A colocated plan
(ClusterSpec.colocate) is lockstep's default world, every rank training and serving: FSDP over all
ranks, or --expert-model-parallel-size = all ranks, or --pipeline-model-parallel-size PP with
PP x EP = all ranks (the plan's last stage given by --decoder-last-pipeline-num-layers); engines of
one GPU each, or one expert-parallel engine over all ranks (--rollout-expert-parallel-size).

`chosen_layout` reads them back from a `lockstep plan --json` file for `lockstep train --layout`.
"""

from __future__ import annotations

from lockstep.files import FileError, read_json
from lockstep.plan.cluster import ClusterSpec, TrainSpec
from lockstep.plan.layout import Layout


def train_flags(layout: Layout, cluster: ClusterSpec, train: TrainSpec, engine_gpus: int = 1,
                last_stage_layers: int | None = None) -> tuple[list[str] | None, str]:
    """(flags, "") when `lockstep train` can run `layout`, else (None, why not). engine_gpus: the
    plan's GPUs per engine; last_stage_layers: its last pipeline stage's layers (colocated PP)."""
    if cluster.colocate:
        return _colocated_flags(layout, cluster, train, engine_gpus, last_stage_layers)
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


def _colocated_flags(layout: Layout, cluster: ClusterSpec, train: TrainSpec, engine_gpus: int,
                     last_stage_layers: int | None) -> tuple[list[str] | None, str]:
    world, why = cluster.actor_gpus, []
    if layout.tp > 1:
        why.append(f"TP {layout.tp}: lockstep has no tensor parallel")
    if layout.cp > 1:
        why.append(f"CP {layout.cp}: lockstep has no context parallel")
    if layout.pp > 1 and layout.pp * layout.ep != world:
        why.append(f"PP {layout.pp} x EP {layout.ep} != the {world} ranks: lockstep's pipelines run one stage per "
                   "rank, more than one pipeline only with the experts sharded over them")
    if layout.pp == 1 and layout.ep > 1 and layout.ep != world:
        why.append(f"EP {layout.ep} < the {world} ranks: lockstep's EP spans every trainer rank")
    if engine_gpus not in (1, world):
        why.append(f"engines of {engine_gpus} GPUs: lockstep's colocated engines take one GPU each or all {world} "
                   "(one expert-parallel engine)")
    if not train.distributed_optimizer:
        why.append("an unsharded optimizer: lockstep's trainer always shards it")
    if why:
        return None, "; ".join(why)
    flags = ["--nnodes", str(cluster.nodes), "--nproc-per-node", str(cluster.gpus_per_node),
             "--max-tokens-per-gpu", str(train.max_tokens_per_gpu)]
    if layout.pp > 1:
        flags += ["--pipeline-model-parallel-size", str(layout.pp)]
        if last_stage_layers is not None:
            flags += ["--decoder-last-pipeline-num-layers", str(last_stage_layers)]
    if layout.ep > 1:
        flags += ["--expert-model-parallel-size", str(layout.ep)]
    if engine_gpus > 1:
        flags += ["--rollout-expert-parallel-size", str(engine_gpus)]
    if train.recompute:
        flags.append("--recompute-activations")
    if train.optimizer_offload:
        flags.append("--optimizer-offload")
    return flags, ""


def layout_label(entry: dict) -> str:
    return " ".join(f"{dim}{entry[dim]}" for dim in ("tp", "pp", "ep", "cp") if dim in entry)


def _field(path, i: int, entry, name: str, types: tuple[type, ...]):
    """Layout #i's field `name`, else FileError naming the file, the layout and the field."""
    if not isinstance(entry, dict):
        raise FileError(f"{path}: layout #{i}: expected a JSON object, got {type(entry).__name__}")
    if name not in entry:
        raise FileError(f"{path}: layout #{i}: missing field {name!r} (lockstep plan --json writes it)")
    value = entry[name]
    if not isinstance(value, types) or (name == "train_flags" and value is not None
                                        and not all(isinstance(f, str) for f in value)):
        raise FileError(f"{path}: layout #{i}: field {name!r}: unexpected value {value!r}")
    return value


def chosen_layout(path) -> tuple[int, dict, list[str]]:
    """(its 1-based rank, the entry, notes on better-ranked layouts passed over) of the layout
    `lockstep train --layout PATH` runs: the plan's best-ranked (first) layout that fits and that
    lockstep can run. `lockstep plan --json` ranks them best first; a layout lockstep cannot run is
    passed over with its not_runnable reason; none left: FileError with the reasons."""
    layouts = read_json(path)
    if not isinstance(layouts, list) or not layouts:
        raise FileError(f"{path}: expected the non-empty JSON list of layouts `lockstep plan --json` writes, "
                        f"got {type(layouts).__name__ if layouts else 'an empty list'}")
    passed = []
    for i, entry in enumerate(layouts, 1):
        feasible = _field(path, i, entry, "feasible", (bool,))
        flags = _field(path, i, entry, "train_flags", (list, type(None)))
        why = _field(path, i, entry, "not_runnable", (str,))
        if feasible and flags is not None:
            return i, entry, passed
        if feasible:
            passed.append(f"#{i} ({layout_label(entry)}) not runnable: {why}")
    if not passed:
        raise FileError(f"{path}: no layout fits (the best, #1 {layout_label(layouts[0])}: {layouts[0].get('reason', '')})")
    raise FileError(f"{path}: lockstep train cannot run any layout that fits: {'; '.join(passed)}")
