"""Pipeline-parallel checkpoints: the one-process format, written and read by the stages of a pipeline.

`save_pipeline` gathers every stage's weights and optimiser state on the first stage, which writes
lockstep/train/checkpointing.py's files; `load_pipeline` has each stage take its own tensors from any
consolidated save (one process's, FSDP's, a PP save of any split). `PipelineTrainer.save / load`
(pipeline_trainer.py) call them.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lockstep.files import FileError
from lockstep.train import checkpointing as ckpt
from lockstep.train.data_parallel import drain

if TYPE_CHECKING:
    from lockstep.dist.pipeline_parallel import PipelineParallel


def save_pipeline(trainer, pipe: PipelineParallel, directory) -> None:
    """The one-process checkpoint (lockstep/train/checkpointing.py), written by the first stage: every
    stage sends it its weights and optimiser state, so the files hold the whole model and any process
    count (1, FSDP, PP) loads them; each stage writes its own RNG states (`checkpointing.trainer_file`
    of its stage index). Consolidated rather than a shard file per stage: one format for every
    layout, and a PP save needs no re-cut to resume on another pipeline split or none. The cost:
    the first stage holds the whole model's weights and optimiser state on the host while writing,
    as FSDP's rank 0 does. Every stage calls it. Pipelines in data parallel (`trainer.dp`, the expert
    shards' group: pipeline_expert_parallel.py) hold the same weights and state; only the first pipeline
    writes (two writers of one file would race) and only its stages send to their first stage; the
    others take part in the gathers of the expert shards (collectives over the pipelines) and keep
    nothing (a whole copy on each pipeline's first stage would multiply the host memory of a save)."""
    d, first, writer = Path(directory), pipe.stage.is_first, trainer.dp.rank == 0
    d.mkdir(parents=True, exist_ok=True)
    # weights, then optimiser state, gathered one tensor at a time (both iterators are lazy), each sent
    # to the first stage or moved to its host at once
    named, entries = trainer.named_weights(), trainer.optimizer.state_entries()
    if not writer:
        drain(itertools.chain(named, entries))
    else:
        weights = _gather_to_first(pipe, trainer.weight_specs(), named, "weights")
        state: dict[str, dict[str, torch.Tensor]] = {}
        for (name, key), t in _gather_to_first(pipe, trainer.optimizer.state_specs(), entries, "optimizer state"):
            state.setdefault(name, {})[key] = t
        if first:
            ckpt.save_weights(weights, d / ckpt.WEIGHTS)
            # step and lr: every stage steps together
            torch.save({**trainer.optimizer.scalars(), "state": state}, d / ckpt.OPTIMIZER)
        ckpt.save_trainer_state(d / ckpt.trainer_file(pipe.stage.stage_index), trainer.num_steps,
                                trainer.config.to_dict())
    with pipe.collective("pipeline-parallel barrier (checkpoint saved)"):
        dist.barrier(group=pipe.group)
    # then the other pipelines' stages wait for the first pipeline's: no rank returns before the files exist
    trainer.dp.barrier("pipeline checkpoint saved")


def load_pipeline(trainer, pipe: PipelineParallel, directory) -> None:
    """Any consolidated checkpoint (one process's, FSDP's, a PP save of any split): each stage copies in
    its own tensors and their optimiser state; a tensor of the file that no stage holds is an error
    (another model). Every stage calls it."""
    d, index = Path(directory), pipe.stage.stage_index
    try:
        mine: set[str] | str = set(trainer.load(d, rank=index))
    except (KeyError, OSError, ValueError) as e:  # sent to the other stages, which would wait otherwise
        mine = f"pipeline stage {index}: {e}"
    outcomes = [None] * pipe.stage.num_stages
    with pipe.collective("pipeline-parallel all_gather_object (checkpoint names no stage holds)"):
        dist.all_gather_object(outcomes, mine, group=pipe.group)
    failed = [o for o in outcomes if isinstance(o, str)]
    if failed:  # every stage raises the same, naming each stage that failed
        raise ValueError("; ".join(failed))
    unclaimed = sorted(set.intersection(*outcomes))
    if unclaimed:
        raise FileError(f"{d / ckpt.WEIGHTS}: no pipeline stage holds {unclaimed[:5]} "
                        f"({len(unclaimed)} in all): a checkpoint of another model")


def _gather_to_first(pipe: PipelineParallel, specs: list[tuple], named, what: str):
    """Every stage's (key, tensor) pairs, in stage order, on the first stage's host (a list there, [] on
    the others): each stage's keys, shapes and dtypes (`specs`) broadcast, then its tensors, taken from
    the iterator `named` one at a time, sent to the first stage (point-to-point, on the pipeline's device)."""
    stage, out = pipe.stage, []
    first = dist.get_global_rank(pipe.group, 0)
    if stage.is_first:
        out += [(k, announced_next(named, k, shape, dtype).cpu()) for k, shape, dtype in specs]
    for s in range(1, stage.num_stages):
        src, mine = dist.get_global_rank(pipe.group, s), s == stage.stage_index
        box = [specs if mine else None]
        with pipe.collective(f"pipeline-parallel broadcast_object_list (stage {s}'s {what}: names)"):
            dist.broadcast_object_list(box, src=src, group=pipe.group, device=pipe.device)
        for key, shape, dtype in box[0]:
            if mine:
                t = announced_next(named, key, shape, dtype)
                with pipe.collective(f"pipeline-parallel send ({what} {key} to stage 0)"):
                    dist.send(t.to(pipe.device), dst=first, group=pipe.group)
            elif stage.is_first:
                t = torch.empty(shape, dtype=dtype, device=pipe.device)
                with pipe.collective(f"pipeline-parallel recv ({what} {key} from stage {s})"):
                    dist.recv(t, src=src, group=pipe.group)
                out.append((key, t.cpu()))
    return out


def announced_next(named, key, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The next (key, tensor) of a stage's iterator `named`, checked against what the stage's header
    announced to the others (a mismatch would leave them receiving the wrong bytes); detached, contiguous."""
    got, t = next(named)
    if (got, tuple(t.shape), t.dtype) != (key, shape, dtype):
        raise RuntimeError(f"pipeline stage tensors: {got} {tuple(t.shape)} {t.dtype} where the stage's header "
                           f"announced {key} {shape} {dtype}")
    return t.detach().contiguous()
