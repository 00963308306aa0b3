"""Pipeline parallelism for the trainer, applied to the one model from outside (DESIGN principle 3).

    stage = split_model(model, pp_rank, pp_size, last_stage_layers=None)     # in place, per rank
    pipe = PipelineParallel(stage, pp_group, device, streams_dtype=torch.float32, collective=ctx.collective)
    losses = pipe.train(input_ids, loss_fn, n_microbatches, forced=None)   # losses on the last stage
    hidden = pipe.forward(input_ids, n_microbatches)                       # no grad, last stage
    logits = stage.logits(hidden, rows)                                    # of the rows wanted only

    # the Trainer through it (pipeline_trainer.py):
    trainer = Trainer(stage, config)              # config.pipeline_model_parallel_size == pp_size
    metrics = pipeline_train_step(trainer, pipe, samples)   # every stage, the step's samples
    old = pipeline_logprobs(trainer, pipe, samples)
    weights = pipeline_named_weights(trainer, pipe)         # the whole model, on every stage
    # or the same as the Trainer seam a loop calls: PipelineTrainer(trainer, pipe).train_step(samples), ...
    PipelineTrainer(trainer, pipe).save(directory)          # the one-process checkpoint; .load(directory)

Split (`stage_layers`): the decoder layers are cut into `pp` contiguous blocks. With
`last_stage_layers` (`--decoder-last-pipeline-num-layers`) the last stage takes that many and the
others share the rest; otherwise all share them. Sizes differ by at most one, the larger blocks
first. The first stage also holds the embedding, the last the mHC head, the final norm and the LM
head. `split_model` drops (in place) every other part of the model from this rank's copy: a layer of
another stage becomes a parameter-less placeholder, so the parameters left keep their full-model
names (`model.layers.2.…`, `lm_head.weight`) and a stage's state dict is the matching slice of
the one-process model's.

What travels between stages, per micro-batch [b, S] (fixed shapes, see below):

    streams  [b, S, n, H]   the mHC streams after the stage's last layer (gradient flows back)
    ids      [b, S] int64   the input ids: hash-routed MoE layers route by token id
    forced   [b, S, L, k]   routing replay only: the experts to use, every layer (no gradient)

The first stage takes (ids[, forced]) as the schedule's inputs; the last returns the final hidden
states [b, S, H] (a true-on-policy training step: the fp32 logits [b, S, V], which carry the
row-block forward's values), and `loss_fn(out, rows)` turns them into the micro-batch's loss,
where `rows` [b] are the micro-batch's row indices into the step's [n_mb * b, S] batch: the loss
looks up whatever per-token values it needs (targets, masks, advantages, normalisers) by row, and
takes the logits of the positions it scores with `stage.logits(out, positions)`, so the [b, S, V]
fp32 logits of every position (GBs per micro-batch at V = 129k) are never made; any loss the
one-process trainer computes from a micro-batch's logits fits the schedule's (output, target)
loss signature.

Schedule: torch.distributed.pipelining's `PipelineStage` with `Schedule1F1B` (`ScheduleGPipe`
when there are fewer micro-batches than stages, which 1F1B refuses); losses are not rescaled
(`scale_grads=False`: the caller's loss already carries its global normaliser, as the Trainer's
does), so the gradients are the sum over micro-batches, as one process accumulating them gets.
The stage metadata is static (example tensors on the meta device, rebuilt for each new
[n_mb, b, S] shape): the schedules' dynamic inference would run later stages on uninitialised
tensors, whose ids and forced experts index out of range.

Fixed shapes: every micro-batch of a step has the same [b, S] (the receive buffers are sized once
per step, as DISTRIBUTED.md says), so variable-length micro-batches are padded by the caller (right
padding: rows are causal from position 0, padding reaches no real token; `pad_microbatches`: b = the
most samples in a micro-batch, S = the longest sample). Equality with one process holds for the same
padded micro-batches; padded to another shape than the one process's, results move by rounding (a
CPU GEMM's rows depend on its row count). Measured, 6 samples in 4 micro-batches of 1-2 samples, 9-14
tokens, all padded to [2, 14]: train_step's metrics within 5.5e-7 relative of the one process's,
weights after a step (lr 1e-2) within 9.3e-7.

`forward` runs the stages without gradients (GPipe's eval under no_grad) and returns the final
hidden states on the last stage [n_mb * b, S, H]: logprobs and scoring, through `stage.logits`.

Proof (tests/dist/test_pipeline_parallel.py, CPU, gloo, tiny DeepSeek-V4): PP=2 forward logits, losses
and every parameter's gradient bitwise equal to one process on the same micro-batches, split 2 + 2 and
3 + 1, with and without routing replay, in fp32 and in bf16 (bf16 streams between the stages); a
stage whose peer never runs raises `DistributedError` naming the step within the timeout; and
`trainer_forward_backward`, the Trainer's own loss (PPO clip, TIS, entropy, global normaliser)
computed on the last stage from the padded micro-batches' logits: loss terms and gradients bitwise
`Trainer.forward_backward`'s in one process when its micro-batches have the same padded shape; and
`pipeline_train_step`, a Trainer per stage taking optimiser steps (gradient-norm squares summed over
the stages, loss terms sent from the last stage): two steps leave every parameter bitwise where two
one-process `Trainer.train_step`s leave it, with all of its metrics; `pipeline_logprobs` is
`Trainer.logprobs` through `forward`; both also with routing replay (the prompts' own routing through
a forward-only pipeline, `pipeline_prompt_routing`, each stage recording its layers' experts);
`pipeline_named_weights` gathers the whole model's weights (the one process's `named_weights`, in its
order) on every stage; `PipelineTrainer` puts the three behind the Trainer's methods (the test's two
steps run through it). Not yet run on GPUs (NCCL).

The RL loop drives a PipelineTrainer (`lockstep train --nproc-per-node 2 --pipeline-model-parallel-size 2`,
lockstep/rl/data_parallel.py: the trainer ranks as one pipeline, colocated engines taking
`pipeline_named_weights`); tests/dist/test_train_world.py: a 3-rollout run logs one process's metrics
bitwise (the same padded micro-batches there).

Several pipelines side by side, each stage's routed experts sharded over the pipelines (PP x EP, with
`--expert-model-parallel-size`): pipeline_grid.py makes the groups, pipeline_expert_parallel.py builds
the trainer; here the Trainer's `dp` (the stage's ranks in every pipeline) makes the pipelines agree on
their micro-batches (`step_microbatches`) and sums the replicated gradients, and the Trainer's own
normalisers, metrics and gradient norm sum over it as they do for EP alone.

Checkpoints (`PipelineTrainer.save` / `load`, pipeline_checkpoint.py): the one-process files
(lockstep/train/checkpointing.py), the stages' weights and optimiser state sent to the first stage,
which writes them; each stage loads its part of any such save (one process's, FSDP's, another
split's). Proof (tests/dist/test_pipeline_checkpoint.py): a PP=2 save resumed on PP=2 takes the unbroken run's next step bitwise,
loaded into one process it gives the same weights, optimiser state and next step, and a one-process
save loads into PP=2; tests/dist/test_train_world.py resumes `lockstep train` on PP=2.

Not built yet (a Trainer with pipeline_model_parallel_size > 1 takes a stage and refuses its own
steps; these functions drive it from outside): PP with a disaggregated layout (the push's manifest
from a stage), a reference model's stages, `routed_experts`
(the trainer's own routing of the responses), PP combined with FSDP, pipelines in data parallel
without EP or with EP smaller than their count, interleaved schedules.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lockstep.models.deepseek_v4 import Routing
from lockstep.models.deepseek_v4_rows import ExactValues, final_rows, runs_true_on_policy
from lockstep.models.layers.attention_rows import FullSequences

Collective = Callable[[str], ContextManager]


def stage_layers(num_layers: int, pp_size: int, last_stage_layers: int | None = None) -> list[range]:
    """The decoder layers of each stage, contiguous, in order (module docstring)."""
    if pp_size < 1:
        raise ValueError(f"pipeline_model_parallel_size must be >= 1, got {pp_size}")
    if pp_size == 1:
        return [range(num_layers)]
    last = last_stage_layers
    if last is not None and not 1 <= last <= num_layers - (pp_size - 1):
        raise ValueError(f"decoder_last_pipeline_num_layers {last}: each of the other {pp_size - 1} stages needs "
                         f"a layer of the {num_layers}")
    if last is None and num_layers < pp_size:
        raise ValueError(f"pipeline_model_parallel_size {pp_size}: more stages than the {num_layers} decoder layers")
    head = pp_size - 1 if last is not None else pp_size
    rest = num_layers - (last or 0)
    sizes = [rest // head + (i < rest % head) for i in range(head)] + ([last] if last is not None else [])
    starts = [sum(sizes[:i]) for i in range(pp_size)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


class _Absent(nn.Module):
    """Where a layer of another stage was: no parameters, never called."""

    def forward(self, *args):
        raise RuntimeError("pipeline parallel: this layer lives on another stage")


class PipelineStageModule(nn.Module):
    """One stage of a DeepSeek-V4 causal LM: its layers, plus the embedding (first stage) or the mHC
    head, final norm and LM head (last stage). Parameter names are the full model's."""

    def __init__(self, model: nn.Module, layers: range, stage_index: int, num_stages: int):
        super().__init__()
        inner = model.model
        self.layer_ids, self.stage_index, self.num_stages = layers, stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        for i in range(len(inner.layers)):
            if i not in layers:
                inner.layers[i] = _Absent()
        if not self.is_first:
            inner.embed_tokens = None
        if not self.is_last:
            inner.norm, inner.hc_head, model.lm_head = None, None, None
        self.model = inner  # registered under the full model's names: model.*, lm_head
        self.lm_head = model.lm_head
        self.config = model.config
        # the model's fp32 rule (lockstep/models/precision.py reads these): a Trainer casting the stage to
        # bf16 keeps fp32 what it keeps in the whole model (mHC, sinks, norms)
        for attr in ("_keep_in_fp32_modules_strict", "_keep_in_fp32_modules"):
            setattr(self, attr, getattr(model, attr, None))
        self._compute_logits = model.compute_logits
        self._head = getattr(model, "_head", None)  # DeepSeek-V4's default LM head (true-on-policy training)
        self.streams_dtype: torch.dtype | None = None  # what the next stage expects (PipelineParallel sets it)
        self.layer_ranges: list[range] = [layers]  # every stage's layers (split_model sets them)
        # a list: each forward appends its micro-batch's chosen experts [b, S, L_stage, k] (prompt routing)
        self.recorded: list[torch.Tensor] | None = None

    @property
    def true_on_policy(self) -> bool:
        """The layers run the true-on-policy forward (models/deepseek_v4_rows.py)."""
        return runs_true_on_policy(self.model.layers[self.layer_ids[0]])

    def carries_exact_streams(self) -> bool:
        """A true-on-policy training step sends two streams between stages: the row-block forward's
        (the loss's values, no autograd) and the default forward's (the gradient's), as one process's
        DeepseekV4ForCausalLM._true_on_policy_logits computes them."""
        return self.true_on_policy and torch.is_grad_enabled()

    def forward(self, *tensors: torch.Tensor):
        """First stage: (ids[, forced]); others: (streams[, exact streams], ids[, forced]). Returns
        (streams[, exact streams], ids[, forced]), or the last stage's final hidden states [b, S, H]
        (fp32 logits [b, S, V] in a true-on-policy training step; `logits` takes either)."""
        if self.is_first:
            ids, *rest = tensors
            streams = exact = self.model.embed_streams(ids)
        elif self.carries_exact_streams():
            streams, exact, ids, *rest = tensors
        else:
            streams, ids, *rest = tensors
        if self.carries_exact_streams():
            return self._exact_values_step(streams, exact, ids, rest)
        routing = Routing(forced=rest[0]) if rest else (Routing() if self.recorded is not None else None)
        call_layer = self.model.call_layer or (lambda layer, *args: layer(*args))
        # the true-on-policy forward: layers given where their keys come from (models/deepseek_v4_rows.py)
        rows = self.true_on_policy
        keys = FullSequences(*ids.shape, ids.device) if rows else None
        for i in self.layer_ids:
            layer = self.model.layers[i]
            streams = call_layer(layer, streams, ids, routing, keys or layer.self_attn.forward_full)
        if self.recorded is not None:
            self.recorded.append(routing.stacked())
        if self.is_last:
            return final_rows(self.model, streams) if rows else self.model.final_hidden(streams)
        return self._send(streams, ids, *rest)

    def outputs_logits(self) -> bool:
        """The last stage returns logits [b, S, V] (a true-on-policy training step), not hidden states."""
        return self.carries_exact_streams()

    def logits(self, out: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The last stage's output for micro-batches [n, S, ...] -> fp32 logits [n, S, V], or
        [len(positions), V] of the flattened [n * S] positions `positions`: the head runs on those
        rows only (its rows are independent: the same bits as picking them from all positions')."""
        if self.outputs_logits():
            return out if positions is None else out.reshape(-1, out.shape[-1])[positions]
        return self._compute_logits(out if positions is None else out.reshape(-1, out.shape[-1])[positions])

    def _exact_values_step(self, streams, exact, ids, rest):
        """This stage of a true-on-policy training step: the row-block layers without autograd, then the
        default layers with the experts they chose forced; the last stage returns the first's logits
        with the second's gradient (deepseek_v4_rows.ExactValues)."""
        chosen = Routing(forced=rest[0] if rest else None)
        with torch.no_grad():
            keys = FullSequences(*ids.shape, ids.device)
            for i in self.layer_ids:
                exact = self.model.layers[i](exact, ids, chosen, keys)
        if self.recorded is not None:
            self.recorded.append(chosen.stacked())
        forced = rest[0] if rest else self._forced_from(chosen, ids.shape)
        routing, call_layer = Routing(forced=forced), self.model.call_layer or (lambda layer, *args: layer(*args))
        for i in self.layer_ids:
            layer = self.model.layers[i]
            streams = call_layer(layer, streams, ids, routing, layer.self_attn.forward_full)
        if self.is_last:
            with torch.no_grad():
                exact_logits = self._compute_logits(final_rows(self.model, exact))
            return ExactValues.apply(self._head(self.model.final_hidden(streams)), exact_logits)
        return self._send(streams, exact, ids, *rest)

    def _forced_from(self, chosen: Routing, shape) -> torch.Tensor:
        """[b, S, L, k] experts with this stage's layers' choices (Routing reads layer i's slice only)."""
        c = self.config
        forced = chosen.chosen[0].new_zeros(*shape, c.num_hidden_layers, c.num_experts_per_tok)
        for i, experts in zip(self.layer_ids, chosen.chosen):
            forced[..., i, :] = experts
        return forced

    def _send(self, streams: torch.Tensor, *rest: torch.Tensor):
        if self.streams_dtype is not None and streams.dtype != self.streams_dtype:
            # the next stage receives into a buffer of the announced dtype: fail here, not with garbage there
            raise ValueError(f"pipeline stage {self.stage_index}: the streams are {streams.dtype}, the pipeline was "
                             f"set up for {self.streams_dtype} (PipelineParallel streams_dtype: the compute dtype)")
        # sent as they are: point-to-point sends take contiguous tensors (mHC's combine may return a view)
        return tuple(t.contiguous() for t in (streams, *rest))


def split_model(model: nn.Module, stage_index: int, num_stages: int,
                last_stage_layers: int | None = None) -> PipelineStageModule:
    """This rank's stage of `model` (cut in place: the other stages' parts are dropped)."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"pipeline stage {stage_index} of {num_stages}")
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_streams") or not hasattr(model, "compute_logits"):
        raise ValueError(f"pipeline parallel: {type(model).__name__} is not a DeepSeek-V4 causal LM "
                         "(model.embed_streams, compute_logits)")
    ranges = stage_layers(len(inner.layers), num_stages, last_stage_layers)
    stage = PipelineStageModule(model, ranges[stage_index], stage_index, num_stages)
    stage.layer_ranges = ranges
    return stage


def load_stage(path, stage_index: int, num_stages: int, last_stage_layers: int | None = None,
               dtype: torch.dtype | None = None, device="cpu", experts: range | None = None) -> PipelineStageModule:
    """This rank's stage read from checkpoint directory `path` and nothing else: the other stages'
    layers (and, with `experts`, the other ranks' routed experts) are never read nor allocated, so a
    model larger than one host's memory can be trained by stages (checkpoint.load_part). The same
    tensors as split_model(load_pretrained(path, dtype), ...) (tests/dist/test_load_stage.py)."""
    from lockstep.models.checkpoint import load_part

    return load_part(path, lambda model: split_model(model, stage_index, num_stages, last_stage_layers),
                     dtype=dtype, device=device, experts=experts)


def _meta(shape, dtype, requires_grad=False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


class PipelineParallel:
    """Runs one stage of a pipeline over micro-batches with torch's schedules (module docstring).
    `streams_dtype`: the dtype of the mHC streams between stages, the run's compute dtype (the
    embedding's: torch.bfloat16 in a bf16 run); a stage whose streams differ raises before sending."""

    def __init__(self, stage: PipelineStageModule, group: ProcessGroup, device: torch.device | str,
                 streams_dtype: torch.dtype = torch.float32, collective: Collective | None = None):
        self.stage, self.group, self.device = stage, group, torch.device(device)
        self.streams_dtype = stage.streams_dtype = streams_dtype
        self.collective = collective or (lambda op: contextlib.nullcontext())

    def _examples(self, b: int, S: int, forced_shape: tuple | None, grad: bool):
        """Static input / output metadata of this stage for [b, S] micro-batches."""
        c = self.stage.config
        passed = [_meta((b, S), torch.int64)] + ([_meta(forced_shape, torch.int64)] if forced_shape else [])
        streams = [_meta((b, S, c.hc_mult, c.hidden_size), self.streams_dtype, requires_grad=grad)]
        if grad and self.stage.true_on_policy:  # the row-block forward's streams travel too, without gradient
            streams.append(_meta((b, S, c.hc_mult, c.hidden_size), self.streams_dtype))
        inputs = tuple(passed) if self.stage.is_first else (*streams, *passed)
        if not self.stage.is_last:
            outputs = (*streams, *passed)
        elif grad and self.stage.true_on_policy:  # PipelineStageModule.outputs_logits
            outputs = _meta((b, S, c.vocab_size), torch.float32, requires_grad=True)
        else:  # the final hidden states, in the streams' dtype
            outputs = _meta((b, S, c.hidden_size), self.streams_dtype, requires_grad=grad)
        return inputs, outputs

    def _run(self, input_ids, n_microbatches: int, microbatch_shape, forced, replay: bool, loss_fn):
        """One schedule step: (losses on the last stage, last-stage outputs merged [n_mb b, S, H] or None)."""
        if self.stage.is_first:
            if input_ids is None or input_ids.shape[0] % n_microbatches:
                raise ValueError(f"pipeline parallel: {n_microbatches} micro-batches of equal size need input_ids "
                                 f"[n_mb * b, S], got {None if input_ids is None else tuple(input_ids.shape)}")
            b, S = input_ids.shape[0] // n_microbatches, input_ids.shape[1]
            replay = forced is not None
        else:
            b, S = microbatch_shape
        L, k = self.stage.config.num_hidden_layers, self.stage.config.num_experts_per_tok
        inputs, outputs = self._examples(b, S, (b, S, L, k) if replay else None, grad=loss_fn is not None)
        pipe_stage = PipelineStage(self.stage, self.stage.stage_index, self.stage.num_stages, self.device,
                                   input_args=inputs, output_args=outputs, group=self.group)
        training = loss_fn is not None
        # forward only: GPipe's fill-drain is just the forwards in order
        kind = Schedule1F1B if training and n_microbatches >= self.stage.num_stages else ScheduleGPipe
        schedule = kind(pipe_stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        args = ()
        if self.stage.is_first:
            args = (input_ids.to(self.device),) + ((forced.to(self.device),) if replay else ())
        what = (f"pipeline-parallel {type(schedule).__name__} {'step' if training else 'forward'} "
                f"(stage {self.stage.stage_index} of {self.stage.num_stages})")
        if not training:
            with self.collective(what), torch.no_grad():
                return None, schedule.eval(*args)
        rows = torch.arange(n_microbatches * b, device=self.device) if self.stage.is_last else None
        losses: list[torch.Tensor] | None = [] if self.stage.is_last else None
        with self.collective(what):
            schedule.step(*args, target=rows, losses=losses, return_outputs=False)
        return losses, None

    def train(self, input_ids: torch.Tensor | None, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              n_microbatches: int, *, microbatch_shape: tuple[int, int] | None = None,
              forced: torch.Tensor | None = None, replay: bool = False) -> list[torch.Tensor] | None:
        """Forward and backward of `n_microbatches` micro-batches; gradients accumulate in the stage's
        parameters. input_ids [n_mb * b, S] (micro-batch i: rows [i b, (i + 1) b)) and forced
        [n_mb * b, S, L, k] are read on the first stage only; the others pass None with
        `microbatch_shape=(b, S)` and `replay` (whether forced routing travels). Returns the
        micro-batch losses (detached) on the last stage, None elsewhere."""
        losses, _ = self._run(input_ids, n_microbatches, microbatch_shape, forced, replay, loss_fn)
        return [loss.detach() for loss in losses] if losses is not None else None

    def forward(self, input_ids: torch.Tensor | None, n_microbatches: int, *,
                microbatch_shape: tuple[int, int] | None = None, forced: torch.Tensor | None = None,
                replay: bool = False) -> torch.Tensor | None:
        """Forward only, no gradient (logprobs, scoring): the final hidden states [n_mb * b, S, H] on the
        last stage (`stage.logits` makes logits of them), None elsewhere; arguments as `train`'s."""
        _, hidden = self._run(input_ids, n_microbatches, microbatch_shape, forced, replay, None)
        return hidden if self.stage.is_last else None
