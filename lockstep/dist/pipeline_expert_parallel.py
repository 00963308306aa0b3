"""Pipeline parallel combined with expert parallel: the trainer layout of the reference run (PP x EP).

    grid = pipeline_grid(ctx, pp)                                   # pipeline_grid.py: pp x ep ranks
    trainer = pipeline_expert_trainer(load_pretrained(path), config, grid, ctx.device, ctx.collective)
    metrics = trainer.train_step(samples)    # the loop's seam: every rank passes the whole batch

Each of the ep pipelines trains its own block of the batch (TrainerShard: block p for pipeline p, the
blocks in pipeline order are the batch). Each rank holds one stage (split_model) whose routed experts
are sharded over the stage's ep group, the same stage in every pipeline (apply_expert_parallel: tokens
of every pipeline's micro-batch go to their experts' rank and back by all-to-all); everything else in
the stage is replicated across the pipelines. The stage's Trainer gets `DataParallel(ep group)`, and
the pieces already written for one pipeline and for EP alone do the rest:

    micro-batches   step_microbatches (pipeline_trainer.py): the pipelines agree on the count and the
                    padded [b, S] (maxed); a pipeline with fewer repeats one at zero weight, since the
                    stage's all-to-alls pair up the pipelines' micro-batches one for one
    normalisers     Trainer._normalisers on the last stage: token / sample counts summed over the
                    pipelines, so every micro-batch loss is divided by the global count
    gradients       replicated ones summed over the pipelines (trainer_forward_backward, DataParallel.
                    sum_grads), expert shards left as they are (the all-to-all's backward already
                    brought every pipeline's tokens' gradient to the expert's rank)
    grad norm       MasterAdamW: the squares of expert shards summed over the ep group, replicated
                    ones counted once; then summed over the stages (pipeline_train_step's stage_sum)
    metrics         loss terms summed, per-sample metrics over the gathered samples (Trainer on the
                    last stage, over the ep group), then sent along the pipeline from its last stage
    logprobs        each pipeline its block, gathered in pipeline order (TrainerShard)
    weights         named_weights: expert shards gathered over the ep group, stages broadcast along
                    each pipeline: the whole model on every rank

Proof (tests/dist/test_pipeline_expert_parallel.py, CPU, gloo, tiny DeepSeek-V4, fp32): PP2 x EP2 on 4
ranks against PP2 x EP1 on 2 (the whole batch through one pipeline). With one micro-batch a pipeline
(also with routing replay), logprobs, every metric, the gradients and the weights after two AdamW steps
are bitwise equal. With more, the expert gradients differ in the last bits (1.2e-7 of the largest
entry), and so the steps after: each stage's all-to-all sums the pipelines' micro-batches pairwise,
(A0 + B0) + A1, where one pipeline accumulates (A0 + A1) + B0, and no order of its micro-batches gives
both that and the replicated gradients' (A0 + A1) + B0. A PP2 x EP2 checkpoint resumes exactly and
loads into one process; `lockstep train --nproc-per-node 4 --pipeline-model-parallel-size 2
--expert-model-parallel-size 2` logs one process's metrics bitwise over 2 rollouts.

Not built: expert-parallel groups smaller than the pipelines' count (EP < DP: experts replicated or
FSDP-sharded over the rest), FSDP of the replicated part, a reference model's stages, a disaggregated
layout, interleaved schedules.
"""

from __future__ import annotations

import torch

from lockstep.dist.expert_parallel import Collective, apply_expert_parallel, ep_mesh
from lockstep.dist.pipeline_grid import PipelineGrid
from lockstep.dist.pipeline_parallel import PipelineParallel, PipelineStageModule, split_model
from lockstep.dist.pipeline_trainer import PipelineTrainer
from lockstep.dist.trainer_shard import TrainerShard
from lockstep.train.data_parallel import DataParallel
from lockstep.train.trainer import Trainer


def pipeline_expert_trainer(model: torch.nn.Module, config, grid: PipelineGrid, device: torch.device,
                            collective: Collective | None = None, ctx=None) -> TrainerShard:
    """This rank's stage of `model` (the whole policy, cut in place; or the stage itself, as
    pipeline_parallel.load_stage reads it, its experts all or this pipeline's window), its
    experts sharded over the grid's ep group, in a PipelineTrainer whose Trainer sums over that group,
    behind TrainerShard (the loop's whole-batch seam). `config.expert_model_parallel_size` must be the
    grid's ep: EP is carved out of the pipelines' data parallel, as without PP. `ctx`: TrainerShard's."""
    if config.expert_model_parallel_size != grid.ep:
        raise ValueError(f"pipeline parallel {grid.pp} over {grid.pp * grid.ep} trainer ranks makes {grid.ep} "
                         f"pipelines, expert_model_parallel_size is {config.expert_model_parallel_size}: the "
                         "experts are sharded over the pipelines (data parallel without EP is not built)")
    stage = model if isinstance(model, PipelineStageModule) else split_model(
        model, grid.stage, grid.pp, config.decoder_last_pipeline_num_layers)
    if stage.stage_index != grid.stage or stage.num_stages != grid.pp:
        raise ValueError(f"pipeline stage {stage.stage_index} of {stage.num_stages} given to the rank of stage "
                         f"{grid.stage} of {grid.pp}")
    if grid.ep > 1:
        apply_expert_parallel(stage, ep_mesh(grid.ep_group, device.type), collective)
    dp = DataParallel(grid.ep_group, device=device, collective=collective)
    pipe = PipelineParallel(stage, grid.pipeline_group, device, streams_dtype=getattr(torch, config.dtype),
                            collective=collective)
    return TrainerShard(PipelineTrainer(Trainer(stage, config, data_parallel=dp), pipe), ctx)
