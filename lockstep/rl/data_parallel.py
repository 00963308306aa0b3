"""An RL run's engine and trainer on N processes, for `build_run`.

Every rank runs the same loop (lockstep/rl/loop.py) on its part of the world (lockstep.dist.groups):

    engine   EngineReplicas: the rank's own Engine on an engine rank; generate() shards the requests
             over the engine ranks and gathers the samples to every rank (lockstep/dist/replicas.py);
             with --rollout-expert-parallel-size (colocated, = the ranks) each rank's engine is its part
             of one expert-parallel engine: its own requests, 1/ep of the routed experts, steps taken
             together (lockstep/dist/engine_expert_parallel.py)
    trainer  on a trainer rank the policy loaded in fp32 (FSDP's shards are the master weights),
             sharded over the trainer group with apply_fsdp (bf16 compute when TrainConfig.dtype says
             so) or, with --expert-model-parallel-size, its routed experts (apply_expert_parallel),
             wrapped in TrainerShard so that the loop's whole-batch calls train each rank's block
             (lockstep/dist/trainer_shard.py)
    weights  colocated (every rank trains and serves): each rank's engine takes its own trainer's full
             weights in-process; disaggregated (--actor-num-gpus T --rollout-num-gpus E: ranks [0, T)
             train, the others serve): push_weights over torch.distributed, with the manifest each
             side derives from its own model and --update-weight-buffer-size buckets

Pipeline parallel (--pipeline-model-parallel-size PP, colocated, PP x EP = the trainer ranks, EP =
--expert-model-parallel-size): the trainer ranks form EP pipelines of PP stages (lockstep/dist/
pipeline_grid.py: each stage's EP ranks consecutive); each rank reads its stage of the checkpoint and
nothing else (pipeline_parallel.load_stage, in TrainConfig.dtype: --decoder-last-pipeline-num-layers
decides the cut; under EP only its block of the routed experts, sharded over the stage's EP ranks),
and is driven through PipelineTrainer behind
TrainerShard (lockstep/dist/pipeline_expert_parallel.py): pipeline p trains block p of the batch (EP 1:
one pipeline, the whole batch); named_weights gathers the whole model on every rank, so each colocated
engine serves the full policy. Rollouts are sharded over the engines as without PP. `pipeline_refusal`
names what PP is not combined with yet (checked before any process starts and again once the world is
known).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def agreed_run_dir(ctx, run_dir):
    """Rank 0's run directory on every rank (a `runs/<timestamp>` name could differ by a second)."""
    box = [str(run_dir) if ctx.rank == 0 else None]
    with ctx.collective("broadcast_object_list of the run directory"):
        dist.broadcast_object_list(box, src=0, group=ctx.control_group)
    return box[0]


def gather_to_every_rank(ctx):
    """callable(obj) -> every rank's obj in rank order, over the control group (RLRun.gather)."""
    def gather(obj):
        out = [None] * ctx.world_size
        with ctx.collective("all_gather_object of the step's per-rank metrics"):
            dist.all_gather_object(out, obj, group=ctx.control_group)
        return out

    return gather


def pipeline_refusal(train_cfg, run_cfg, trainer_ranks: int, colocated: bool) -> str | None:
    """Why this pipeline-parallel run cannot run yet, or None (also None without PP)."""
    pp = train_cfg.pipeline_model_parallel_size
    if pp == 1:
        if train_cfg.decoder_last_pipeline_num_layers is not None:
            return "--decoder-last-pipeline-num-layers needs --pipeline-model-parallel-size > 1"
        return None
    if not colocated:
        return (f"--pipeline-model-parallel-size {pp} runs colocated only for now (every rank trains and serves): "
                "drop --actor-num-gpus / --rollout-num-gpus")
    ep = train_cfg.expert_model_parallel_size
    if pp * ep != trainer_ranks:
        sizes = f"--pipeline-model-parallel-size {pp}" + (f" x --expert-model-parallel-size {ep}" if ep > 1 else "")
        return (f"{sizes} must equal the trainer ranks for now (one stage per rank; more pipelines than one only "
                "with their experts sharded over them: data parallel across pipelines without EP, or EP smaller "
                f"than the pipelines, is not built), here {trainer_ranks}: run {pp * ep} processes in all "
                "(--nproc-per-node x --nnodes)")
    if train_cfg.kl_loss_coef > 0:
        return f"--pipeline-model-parallel-size {pp} with --kl-loss-coef > 0: a reference model's stages are not built yet"
    return None


def check_pipeline(train_cfg, run_cfg, trainer_ranks: int, colocated: bool) -> None:
    why = pipeline_refusal(train_cfg, run_cfg, trainer_ranks, colocated)
    if why:
        raise ValueError(why)


def _pipeline_trainer(ctx, path, train_cfg):
    """This rank's stage of the policy, experts sharded over the pipelines, behind TrainerShard (module
    docstring). Every rank makes the grid's groups, before anything else of the trainer."""
    from ..dist.expert_parallel import checkpoint_expert_window
    from ..dist.pipeline_expert_parallel import pipeline_expert_trainer
    from ..dist.pipeline_grid import pipeline_grid
    from ..dist.pipeline_parallel import load_stage

    grid = pipeline_grid(ctx, train_cfg.pipeline_model_parallel_size)
    # only this rank's stage and, under EP, its pipeline's block of the experts is read: no rank holds
    # the whole model, as the reference layout's 284B model requires
    experts = checkpoint_expert_window(path, grid.ep, grid.pipeline) if grid.ep > 1 else None
    stage = load_stage(path, grid.stage, grid.pp, train_cfg.decoder_last_pipeline_num_layers,
                       dtype=getattr(torch, train_cfg.dtype), device=ctx.device, experts=experts)
    return pipeline_expert_trainer(stage, train_cfg, grid, ctx.device, ctx.collective, ctx)


def _sharded_trainer(ctx, path, train_cfg, ref_model_fn):
    """FSDP2 over the trainer ranks, or with --expert-model-parallel-size (= the trainer ranks) the
    routed experts sharded and the rest replicated (lockstep/dist/expert_parallel.py): each rank then
    reads only its block of the experts, unless the KL reference (a copy of the policy as loaded, not
    sharded) needs them all."""
    from ..dist.expert_parallel import load_expert_parallel, shard_experts
    from ..dist.fsdp import apply_fsdp, dp_mesh
    from ..models import load_pretrained
    from ..train.data_parallel import DataParallel
    from ..train.trainer import Trainer

    ep = train_cfg.expert_model_parallel_size
    if ep > 1 and train_cfg.kl_loss_coef == 0:
        policy, ref_model = load_expert_parallel(path, ep, ctx, torch.float32), None
    else:
        policy = load_pretrained(path, dtype=torch.float32, device=ctx.device)
        ref_model = ref_model_fn(policy)  # from the policy as loaded, before it is sharded
        if ep > 1:
            shard_experts(policy, ep, ctx)  # refuses EP != trainer ranks
        else:
            apply_fsdp(policy, dp_mesh(ctx.trainer_group, ctx.device.type),
                       param_dtype=getattr(torch, train_cfg.dtype), offload=train_cfg.optimizer_offload)
    dp = DataParallel(ctx.trainer_group, device=ctx.device if ctx.device.type == "cuda" else "cpu",
                      collective=ctx.collective)
    return Trainer(policy, train_cfg, ref_model=ref_model, data_parallel=dp)


def _engine(ctx, path, engine_cfg, rollout_ep_size: int):
    """This rank's Engine, or with --rollout-expert-parallel-size its rank of the expert-parallel engine
    (each rank serves its own requests with 1/ep of the routed experts: engine_expert_parallel.py)."""
    if rollout_ep_size > 1:
        from ..dist.engine_expert_parallel import expert_parallel_engine_from_pretrained

        return expert_parallel_engine_from_pretrained(ctx, path, engine_cfg, rollout_ep_size)
    from ..engine.engine import Engine

    return Engine.from_pretrained(path, engine_cfg)


def data_parallel_components(ctx, path, train_cfg, engine_cfg, ref_model_fn, weight_buffer_size: int, run_cfg=None,
                             rollout_ep_size: int = 1):
    """(EngineReplicas, TrainerShard) of this rank (with PP: over a PipelineTrainer).
    `ref_model_fn(policy)` gives the KL reference; `run_cfg`: checked for what PP refuses;
    `rollout_ep_size` > 1: the engines are one expert-parallel engine (DistConfig checked the layout)."""
    from ..dist.manifest import build_manifest
    from ..dist.replicas import EngineReplicas
    from ..dist.trainer_shard import TrainerShard
    from ..models.tokenizer import has_tokenizer, load_tokenizer

    if train_cfg.pipeline_model_parallel_size > 1:
        if run_cfg is not None:
            check_pipeline(train_cfg, run_cfg, len(ctx.layout.trainer_ranks), ctx.layout.is_colocated)
        engine = _engine(ctx, path, engine_cfg, rollout_ep_size)
        return EngineReplicas(ctx, engine), _pipeline_trainer(ctx, path, train_cfg)
    engine = _engine(ctx, path, engine_cfg, rollout_ep_size) if ctx.is_engine else None
    trainer = _sharded_trainer(ctx, path, train_cfg, ref_model_fn) if ctx.is_trainer else None
    manifest = None
    if not ctx.layout.is_colocated:  # each side from its own copy of the model (manifest.py)
        model = trainer.model if trainer is not None else engine.model
        manifest = build_manifest(model, getattr(torch, train_cfg.dtype), weight_buffer_size)
    tokenizer = load_tokenizer(path) if engine is None and has_tokenizer(path) else None
    return (EngineReplicas(ctx, engine, tokenizer=tokenizer, manifest=manifest),
            TrainerShard(trainer, ctx, config=train_cfg))
