"""An RL run's engine and trainer on N processes (colocated, data parallel), for `build_run`.

Every rank of a colocated world (lockstep.dist.groups) holds one engine replica and one FSDP shard of
the trainer:

    engine   EngineReplicas: the rank's own Engine; generate() shards the requests over the engine
             ranks and gathers the samples to every rank (lockstep/dist/replicas.py)
    trainer  the policy loaded in fp32 (FSDP's shards are the master weights), sharded over the
             trainer group with apply_fsdp (bf16 compute when TrainConfig.dtype says so), wrapped in
             TrainerShard so that the loop's whole-batch calls train each rank's block
    weights  after a step each rank's engine takes its own trainer's full weights in-process
             (`named_weights` gathers the shards on every rank): no broadcast is needed when every
             rank serves what it trains

The disaggregated layout (--actor-num-gpus / --rollout-num-gpus) has its weight push
(lockstep/dist/weight_push.py) but no loop yet: it is refused here with that said.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def check_layout(ctx) -> None:
    if not ctx.layout.is_colocated:
        raise ValueError(f"rank {ctx.rank}: lockstep train runs the colocated layout only (every rank trains and "
                         f"serves); --actor-num-gpus / --rollout-num-gpus (disaggregated) are not built into the "
                         f"loop yet")


def agreed_run_dir(ctx, run_dir):
    """Rank 0's run directory on every rank (a `runs/<timestamp>` name could differ by a second)."""
    box = [str(run_dir) if ctx.rank == 0 else None]
    with ctx.collective("broadcast_object_list of the run directory"):
        dist.broadcast_object_list(box, src=0, group=ctx.control_group)
    return box[0]


def data_parallel_components(ctx, engine, path, train_cfg, ref_model_fn):
    """(EngineReplicas over `engine`, TrainerShard of an FSDP Trainer on the model at `path`).
    `ref_model_fn(policy)` gives the KL reference from the policy before it is sharded."""
    from ..dist.fsdp import apply_fsdp, dp_mesh
    from ..dist.replicas import EngineReplicas
    from ..dist.trainer_shard import TrainerShard
    from ..models import load_pretrained
    from ..train.data_parallel import DataParallel
    from ..train.trainer import Trainer

    check_layout(ctx)
    policy = load_pretrained(path, dtype=torch.float32, device=ctx.device)
    ref_model = ref_model_fn(policy)
    apply_fsdp(policy, dp_mesh(ctx.trainer_group, ctx.device.type), param_dtype=getattr(torch, train_cfg.dtype),
               offload=train_cfg.optimizer_offload)
    dp = DataParallel(ctx.trainer_group, device=ctx.device if ctx.device.type == "cuda" else "cpu",
                      collective=ctx.collective)
    trainer = Trainer(policy, train_cfg, ref_model=ref_model, data_parallel=dp)
    return EngineReplicas(ctx, engine), TrainerShard(trainer)
