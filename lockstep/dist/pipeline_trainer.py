"""The Trainer driven through a pipeline (PipelineParallel, pipeline_parallel.py): its micro-batches
padded to the schedule's one shape, logprobs and routing replay through forward-only pipelines, the
loss on the last stage, gradients summed over pipelines in data parallel, whole-model weights for the
engines, and `PipelineTrainer`, which puts these behind the Trainer's methods for the RL loop (the
pipeline_parallel.py docstring says what each proves).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lockstep.dist.pipeline_checkpoint import announced_next, load_pipeline, save_pipeline
from lockstep.dist.pipeline_parallel import PipelineParallel
from lockstep.models.deepseek_v4 import padded_ids, padded_rows
from lockstep.train.logprobs import MicroBatch, pack_microbatches, token_logprobs
from lockstep.train.routing_replay import forced_experts


def pad_microbatches(mbs: list[MicroBatch], at_least: tuple[int, int] = (1, 1)) -> tuple[torch.Tensor, int, int]:
    """(ids [n_mb * b, S], b, S) of packed micro-batches: b = the most samples in one, S = the longest
    sample (each at least `at_least`'s); micro-batch i's samples are rows i b, i b + 1, ..., right-padded
    with 0, its other rows all 0. When every micro-batch has b samples and a sample of length S, these
    are the [b, S] batches the one-process model pads them to (`forward_packed`)."""
    lens = [(mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist() for mb in mbs]
    b, S = max(at_least[0], *(len(x) for x in lens)), max(at_least[1], *(max(x) for x in lens))
    return torch.cat([padded_ids(mb.input_ids, mb.cu_seqlens, (b, S)) for mb in mbs]), b, S


def step_microbatches(trainer, samples) -> tuple[list[MicroBatch], int, torch.Tensor, int, int]:
    """(micro-batches, how many are real, ids [n_mb b, S], b, S) of this pipeline's samples. With data
    parallel across pipelines (`trainer.dp`: this stage's ranks in every pipeline, the expert-parallel
    group) the pipelines agree on n_mb, b and S (maxed): each stage's expert all-to-alls pair up one
    micro-batch of every pipeline, so all run as many, and one shape makes each pipeline's padded
    micro-batches those of a single pipeline over the whole batch. A pipeline with fewer repeats its
    first micro-batch, at zero loss weight (as the Trainer's data-parallel ranks do). One pipeline:
    its own micro-batches, no collective."""
    mbs = pack_microbatches(samples, trainer.config.max_tokens_per_gpu)
    ids, b, S = pad_microbatches(mbs)
    real = len(mbs)
    if trainer.dp.enabled:
        n, b, S = trainer.dp.max_ints([real, b, S], "pipeline micro-batch count and shape")
        mbs = mbs + [mbs[0]] * (n - real)
        ids, b, S = pad_microbatches(mbs, (b, S))
    return mbs, real, ids, b, S


def _response_logits(stage, out: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """The last stage's output of a micro-batch padded to [b, S] -> logits [T_r, V], those predicting
    its response tokens (the rows the one-process forward takes: `padded_rows`, here of [b, S])."""
    return stage.logits(out, padded_rows(mb.cu_seqlens, out.shape[1], mb.logit_index).to(out.device))


def _from_last(pipe: PipelineParallel, obj, what: str):
    """`obj` of the last stage, on every stage (pickled: small metadata and metrics)."""
    box = [obj]
    with pipe.collective(f"pipeline-parallel broadcast_object_list ({what})"):
        dist.broadcast_object_list(box, src=dist.get_global_rank(pipe.group, pipe.stage.num_stages - 1),
                                   group=pipe.group, device=pipe.device)
    return box[0]


@torch.no_grad()
def pipeline_logprobs(trainer, pipe: PipelineParallel, samples) -> list[torch.Tensor]:
    """`Trainer.logprobs` through the pipeline's forward: per-sample [R_i] float32 logprobs, on every
    stage (sent from the last); routing replay as in `trainer_forward_backward`."""
    mbs, real, ids, b, S = step_microbatches(trainer, samples)
    replay = trainer.config.use_rollout_routing_replay
    forced = _replay_forced(pipe, mbs, samples, b, S, trainer.dp.enabled) if replay else None
    first = pipe.stage.is_first
    hidden = pipe.forward(ids if first else None, len(mbs), microbatch_shape=(b, S),
                          forced=forced if first else None, replay=replay)
    out: list[torch.Tensor | None] = [None] * len(samples)
    if pipe.stage.is_last:
        for i, mb in enumerate(mbs[:real]):
            packed = _response_logits(pipe.stage, hidden[i * b:(i + 1) * b], mb)
            logp = token_logprobs(packed, mb.targets.to(packed.device), trainer.config.temperature,
                                  trainer.fused_logprobs)
            for j, lp in zip(mb.indices, mb.split_responses(logp.cpu())):
                out[j] = lp
    return _from_last(pipe, out, "logprobs")


@torch.no_grad()
def pipeline_prompt_routing(pipe: PipelineParallel, prefixes, always_forward: bool = False) -> list[torch.Tensor]:
    """`routing_replay.prompt_routing` through the pipeline (every stage calls it with the same prefixes):
    the model's own experts [P_i, L, k] for each token sequence, distinct non-empty ones in one
    forward-only micro-batch [n_unique, P_max] (the one process's batch); each stage records its
    layers' choices and broadcasts them, so every stage returns all layers'. always_forward: a forward
    over one token even when every prefix is empty (its routing unused): the pipelines of an
    expert-parallel stage exchange tokens in every forward, so each runs as many."""
    stage, c = pipe.stage, pipe.stage.config
    L, k = c.num_hidden_layers, c.num_experts_per_tok
    keys = [tuple(p.tolist()) for p in prefixes]
    unique = [key for key in dict.fromkeys(keys) if key]
    own = {(): torch.zeros(0, L, k, dtype=torch.int64)}
    if not unique and always_forward:
        pipe.forward(torch.zeros(1, 1, dtype=torch.int64) if stage.is_first else None, 1, microbatch_shape=(1, 1))
    if unique:
        ids = nn.utils.rnn.pad_sequence([torch.tensor(key, dtype=torch.int64) for key in unique], batch_first=True)
        stage.recorded = []
        try:
            pipe.forward(ids if stage.is_first else None, 1, microbatch_shape=tuple(ids.shape))
            mine = stage.recorded[0]
        finally:
            stage.recorded = None
        pieces = []
        for s, layers in enumerate(stage.layer_ranges):
            t = mine.contiguous() if s == stage.stage_index else \
                torch.empty(*ids.shape, len(layers), k, dtype=mine.dtype, device=pipe.device)
            with pipe.collective(f"pipeline-parallel broadcast (stage {s}'s prompt routing)"):
                dist.broadcast(t, src=dist.get_global_rank(pipe.group, s), group=pipe.group)
            pieces.append(t.cpu())
        stacked = torch.cat(pieces, dim=2)  # [n_unique, P_max, L, k]
        own.update({key: stacked[i, :len(key)].long() for i, key in enumerate(unique)})
    return [own[key] for key in keys]


def _replay_forced(pipe: PipelineParallel, mbs: list[MicroBatch], samples, b: int, S: int,
                   always_forward: bool = False) -> torch.Tensor:
    """Routing replay's forced experts [n_mb b, S, L, k] of the padded micro-batches (routing_replay.py's
    rule per sample; padding rows and positions get experts 0..k-1, reaching no loss)."""
    c = pipe.stage.config
    L, k = c.num_hidden_layers, c.num_experts_per_tok
    forced = torch.arange(k).expand(len(mbs) * b, S, L, k).clone()
    for i, mb in enumerate(mbs):
        chosen = [samples[j] for j in mb.indices]
        for j, s in zip(mb.indices, chosen):
            if s.routed_experts is None or tuple(s.routed_experts.shape[1:]) != (L, k):
                raise ValueError(f"sample {j}: routing replay needs routed_experts [R, {L}, {k}]")
        own = pipeline_prompt_routing(pipe, [s.prompt_ids[:-1] for s in chosen], always_forward)
        mb_forced = forced_experts(chosen, own, L, k, "cpu")
        forced[i * b:i * b + len(chosen), :mb_forced.shape[1]] = mb_forced
    return forced


def trainer_forward_backward(trainer, pipe: PipelineParallel, samples, old_logprobs=None) -> dict[str, float] | None:
    """The gradient accumulation of `Trainer.forward_backward` through the pipeline: every stage calls it
    with the step's samples and a Trainer over its stage (its config packs the micro-batches); the last
    stage computes the Trainer's own loss of each micro-batch from the logits of its real rows
    (`Trainer._microbatch_loss(..., logits=)`). Returns the summed loss stats on the last stage (None
    elsewhere): `Trainer.forward_backward`'s metrics. Routing replay: the prompts' own routing through a
    forward-only pipeline per micro-batch (`pipeline_prompt_routing`), the forced experts sent from the
    first stage. Data parallel across pipelines (`trainer.dp`, pipeline_expert_parallel.py): the
    normalisers and metrics are the global batch's, the replicated gradients summed over the pipelines.
    Not yet: a reference model."""
    if trainer.ref_model is not None:
        raise ValueError("pipeline parallel: the trainer's loss on the last stage takes no reference model yet")
    mbs, real, ids, b, S = step_microbatches(trainer, samples)
    replay = trainer.config.use_rollout_routing_replay
    forced = _replay_forced(pipe, mbs, samples, b, S, trainer.dp.enabled) if replay else None
    totals: dict[str, torch.Tensor] = {}
    before: list[torch.Tensor | None] = [None] * len(samples)  # the logprobs before the update, per sample
    norms = trainer._normalisers(samples) if pipe.stage.is_last else None
    trainer.model.train()

    def loss_fn(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        index = int(rows[0]) // b
        mb = mbs[index]
        packed = _response_logits(pipe.stage, out, mb)
        loss, stats, mb_before = trainer._microbatch_loss(mb, samples, norms, old_logprobs, logits=packed)
        if index >= real:  # a repeat for the other pipelines' count (step_microbatches): no weight, no stats
            return loss * 0.0
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v
        for i, lp in zip(mb.indices, mb.split_responses(mb_before.cpu())):
            before[i] = lp
        return loss

    first = pipe.stage.is_first
    pipe.train(ids if first else None, loss_fn, len(mbs), microbatch_shape=(b, S),
               forced=forced if first else None, replay=replay)
    # pipelines in data parallel: each replicated parameter's gradient is this pipeline's tokens' part of
    # the global loss's (the normalisers are global), so the sum over the pipelines is the global gradient;
    # expert shards (DTensors) already hold every pipeline's tokens (the all-to-all's backward brought them)
    trainer.dp.sum_grads(p for p in pipe.stage.parameters() if not isinstance(p, DTensor))
    return trainer._loss_metrics(totals, samples, before, norms, real) if pipe.stage.is_last else None


def pipeline_train_step(trainer, pipe: PipelineParallel, samples, old_logprobs=None) -> dict[str, float]:
    """One optimiser step of `Trainer`s over the stages (every stage calls it with the step's samples):
    `trainer_forward_backward`, the last stage's loss terms sent to every stage, the gradient norm's
    squares summed over the stages (`MasterAdamW.stage_sum`), so every stage clips by the global norm
    and AdamW updates its own parameters as one process updates them (`Trainer.optimiser_step`).
    Returns `Trainer.train_step`'s metrics, the same on every stage."""
    def stage_sum(total: torch.Tensor) -> torch.Tensor:
        t = total.to(pipe.device)
        with pipe.collective("pipeline-parallel all_reduce (gradient norm squares over the stages)"):
            dist.all_reduce(t, group=pipe.group)
        return t.cpu()

    trainer.optimizer.stage_sum = stage_sum
    metrics = _from_last(pipe, trainer_forward_backward(trainer, pipe, samples, old_logprobs), "the step's metrics")
    return trainer.optimiser_step(dict(metrics))


def pipeline_named_weights(trainer, pipe: PipelineParallel):
    """`Trainer.named_weights` of the whole model, on every stage: each stage's tensors in stage order
    (the stages are contiguous, so this is the one-process model's state-dict order), broadcast from
    their stage (names, shapes and dtypes first, then one broadcast per tensor). What a checkpoint or
    a weight push of a pipeline-parallel trainer needs from its source rank; every stage must iterate.
    A stage gathers its own tensors one at a time, as they are broadcast (the header comes from
    `Trainer.weight_specs`): under EP, gathering a stage's whole experts at once would hold a quarter
    of a PP-4 model's expert bytes on one GPU."""
    specs, own = trainer.weight_specs(), trainer.named_weights()
    for s in range(pipe.stage.num_stages):
        src = dist.get_global_rank(pipe.group, s)
        mine = s == pipe.stage.stage_index
        box = [specs if mine else None]
        with pipe.collective(f"pipeline-parallel broadcast_object_list (stage {s}'s weight names)"):
            dist.broadcast_object_list(box, src=src, group=pipe.group, device=pipe.device)
        for name, shape, dtype in box[0]:
            t = announced_next(own, name, shape, dtype) if mine else torch.empty(shape, dtype=dtype, device=pipe.device)
            with pipe.collective(f"pipeline-parallel broadcast ({name} from stage {s})"):
                dist.broadcast(t, src=src, group=pipe.group)
            yield name, t


class PipelineTrainer:
    """The Trainer seam (`train_step`, `logprobs`, `named_weights`, `config`) for a pipeline-parallel
    rank: every stage's rank calls each method with the step's samples, as a one-process loop calls a
    Trainer; the results are the same on every stage. `trainer` is a Trainer over this rank's stage
    (its config's pipeline_model_parallel_size the number of stages). `save` / `load`: the consolidated
    checkpoint of one process (any process count loads it)."""

    def __init__(self, trainer, pipe: PipelineParallel):
        if trainer.model is not pipe.stage:
            raise ValueError("PipelineTrainer: the Trainer must hold the pipeline's stage")
        self.trainer, self.pipe = trainer, pipe

    @property
    def config(self):
        return self.trainer.config

    @property
    def num_steps(self) -> int:
        return self.trainer.num_steps

    @property
    def dp(self):
        """The data parallel across pipelines (this stage's ranks in every pipeline; one pipeline: none):
        TrainerShard (trainer_shard.py) cuts the loop's batch by it, one block a pipeline."""
        return self.trainer.dp

    def logprobs(self, samples) -> list[torch.Tensor]:
        return pipeline_logprobs(self.trainer, self.pipe, samples)

    def train_step(self, samples, old_logprobs=None) -> dict[str, float]:
        return pipeline_train_step(self.trainer, self.pipe, samples, old_logprobs)

    def named_weights(self):
        return pipeline_named_weights(self.trainer, self.pipe)

    def save(self, directory) -> None:
        """The one-process checkpoint, written by the first stage (pipeline_checkpoint.py). Every stage calls it."""
        save_pipeline(self.trainer, self.pipe, directory)

    def load(self, directory) -> None:
        """Any consolidated checkpoint, each stage taking its own part (pipeline_checkpoint.py). Every stage calls it."""
        load_pipeline(self.trainer, self.pipe, directory)
