"""`Trainer`: the policy-update seam (DESIGN.md "The seams").

    trainer = Trainer(model, TrainConfig(...), ref_model=None)
    old = trainer.logprobs(samples)          # per-sample [R] logprobs, no grad
    metrics = trainer.train_step(samples)    # one optimiser step; DESIGN.md metric names
    engine.update_weights(trainer.named_weights(), version)

One `train_step` = forward/backward over micro-batches of at most `max_tokens_per_gpu` tokens
(gradients accumulate; the loss normaliser is global, so the split does not matter), then one
AdamW step. pi_old defaults to the weights at the start of the step (the grad forward's own
logprobs, detached: ratio 1, on-policy), so no extra forward is spent; for several steps per
rollout compute `old = trainer.logprobs(samples)` once and pass `old_logprobs=old` to each step;
`use_rollout_logprobs` takes pi_old from the engine instead. Per token (see losses.py):

    log_ratio = logp - old_logp         (GSPO: the sequence-level ratio)
    pg        = PPO-clip(log_ratio, A; eps_clip, eps_clip_high, dual_clip_c) * w_IS (TIS / MIS)
    loss      = agg(pg) - entropy_coef * agg(H) + kl_loss_coef * agg(KL_k(logp, ref_logp))

The train/rollout mismatch (`train/train_rollout_logprob_abs_diff`, `train/train_rollout_kl`) is
always measured, between the trainer's logprobs before the update and the rollout's; every metric's
definition (Miles' where Miles has the name) is tabled in mismatch.py. A loss or
gradient that is not finite skips the optimiser step and leaves weights and optimiser state as
they were (`train/skipped_nonfinite` = 1). `num_steps` counts optimiser steps taken.

Wrappers are applied from outside the model (DESIGN principle 3), in this order: dtype (bf16
compute, fp32 masters in the optimiser), quantisation-aware forward, activation recomputation.

Data parallel (FSDP2): shard the fp32 model with `lockstep.dist.fsdp.apply_fsdp` first, then pass
`data_parallel=DataParallel(group)`; each rank calls every method with its own samples (at least
one). The dtype is then FSDP's MixedPrecisionPolicy (no cast here), the optimiser steps the local
shards, and data_parallel.py says what is summed across ranks so that the step, its metrics and
`named_weights` (full tensors) are those of one process on all the samples.

Pipeline parallel: `pipeline_model_parallel_size` > 1 takes one stage of the model
(`lockstep.dist.pipeline_parallel.split_model`); the steps and logprobs then run through that module
(`pipeline_train_step`, `pipeline_logprobs`), which uses this Trainer's loss, metrics and optimiser.

Expert parallel: shard the routed experts with `lockstep.dist.expert_parallel.apply_expert_parallel`
over the data-parallel ranks and pass `data_parallel=DataParallel(group)` of the same ranks
(`expert_model_parallel_size` must equal their number). The expert shards are DTensors, so the
optimiser, the gradient norm, `named_weights` and checkpoints treat them as FSDP's shards; every
other parameter is replicated and its gradient summed over the ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lockstep.models.compiled_layers import compile_layers
from lockstep.models.deepseek_v4 import Routing
from lockstep.models.layers.kernel_switch import (TRAINER_ONLY, KernelSwitches, decide_true_on_policy,
                                                  set_kernel_switches)
from lockstep.models.precision import cast_model, storage_dtype
from lockstep.sample import Sample
from lockstep.train import checkpointing as ckpt
from lockstep.train.aggregation import aggregate, pack
from lockstep.train.config import TrainConfig
from lockstep.train.cuda_graphs import GraphedLogprobs, detach_grads
from lockstep.train.data_parallel import DataParallel, drain, gather_full, local_part
from lockstep.train.logprobs import MicroBatch, accepts, microbatch_logits, pack_microbatches, token_logprobs, \
    token_logprobs_and_entropy
from lockstep.train.losses import gspo_log_ratio, kl_penalty, ppo_policy_loss
from lockstep.train.mismatch import importance_weights, importance_weights_only, metric_ratio, mismatch_metrics
from lockstep.train.optimizer import MasterAdamW
from lockstep.train.quant_aware import apply_quant_aware, canonical_name
from lockstep.train.weight_walk import WeightWalk
from lockstep.train.recompute import apply_recompute
from lockstep.train.routing_replay import replay_routing, response_experts
from lockstep.transfer import to_device, to_host_async


class Trainer:
    """RL trainer over one model; see the module docstring."""

    def __init__(self, model: nn.Module, config: TrainConfig, ref_model: nn.Module | None = None,
                 data_parallel: DataParallel | None = None):
        self.device = next(model.parameters()).device
        # None decided here, once: every later reader sees a bool
        config = dataclasses.replace(config, true_on_policy=decide_true_on_policy(
            config.true_on_policy, model, self.device, config.true_on_policy_excluded_by()))
        self.config, self.model, self.ref_model = config, model, ref_model
        self.dp = data_parallel or DataParallel()
        # FSDP applied (expert parallel alone also makes DTensors, but leaves the dtype to the Trainer)
        self.sharded = any(isinstance(m, FSDPModule) for m in model.modules())
        self.num_steps = 0
        self._weights = WeightWalk(model)  # named_weights' walk, kept (train/weight_walk.py)
        self._setup_determinism()
        self._check(model, ref_model)
        switches = KernelSwitches(compile_hc=config.compile_hc, true_on_policy=config.true_on_policy,
                                  **{name: getattr(config, name) for name in TRAINER_ONLY})
        for m in (model, ref_model):  # the model imports no config (kernel_switch.py)
            if m is not None:
                set_kernel_switches(m, switches)
        # the loss's logprobs are the trainer's own (train/logprobs.py), not the model's: it keeps the
        # switch (None: on CUDA; off in the true-on-policy forward)
        self.fused_logprobs = switches.on("fused_logprobs")
        if config.true_on_policy and not hasattr(model, "true_on_policy"):
            raise ValueError(f"TrainConfig.true_on_policy: {type(model).__name__} has no true-on-policy forward "
                             "(DeepSeek-V4 has)")
        masters = self._prepare_dtype()
        if config.quant_aware_forward:
            apply_quant_aware(model, config.quant_aware_forward)
        if config.recompute_activations:
            apply_recompute(model)
        self.graphs = self._graphs() if config.train_cuda_graphs else None
        if config.compile_backend is not None:
            if not hasattr(getattr(model, "model", None), "call_layer"):
                raise ValueError(f"compile_backend: {type(model).__name__} has no compilable decoder layers")
            compile_layers(model, config.compile_backend)
        c = config
        # FSDP's CPUOffloadPolicy already keeps the sharded masters on the host
        self.optimizer = MasterAdamW(self._named_parameters(), lr=c.lr, betas=(c.adam_beta1, c.adam_beta2),
                                     eps=c.adam_eps, weight_decay=c.weight_decay,
                                     offload=c.optimizer_offload and not self.sharded, data_parallel=self.dp,
                                     triton=c.triton_adamw)
        with torch.no_grad():
            for name, value in masters.items():  # fp32 values from before the bf16 cast
                self.optimizer.slots[name].master.copy_(value.to_local() if isinstance(value, DTensor) else value)

    # ---- setup ----------------------------------------------------------------------------

    def _graphs(self) -> GraphedLogprobs:
        if self.device.type != "cuda":
            raise ValueError(f"TrainConfig.train_cuda_graphs: CUDA graphs need the model on a CUDA device, not {self.device}")
        if self.sharded:
            raise ValueError("TrainConfig.train_cuda_graphs: FSDP gathers parameters inside the forward; not recorded yet")
        c = self.config
        return GraphedLogprobs(self.model, c.temperature, c.entropy_coef > 0, self.fused_logprobs, c.train_cuda_graph_shapes)

    def _setup_determinism(self) -> None:
        torch.manual_seed(self.config.seed)
        if self.config.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.benchmark = False

    def _check(self, model: nn.Module, ref_model: nn.Module | None) -> None:
        c = self.config
        # a pipeline stage takes the forced routing as a tensor between stages (lockstep.dist.pipeline_parallel)
        if c.use_rollout_routing_replay and c.pipeline_model_parallel_size == 1 and not accepts(model, "routing"):
            raise ValueError(f"use_rollout_routing_replay: {type(model).__name__} takes no routing argument")
        if c.kl_loss_coef > 0 and ref_model is None:
            raise ValueError("kl_loss_coef > 0 needs a ref_model")
        ep = c.expert_model_parallel_size
        if ep > 1 and (self.dp.size != ep or not any(isinstance(p, DTensor) for p in model.parameters())):
            raise ValueError(f"expert_model_parallel_size {ep}: shard the experts first (lockstep.dist."
                             f"expert_parallel) over the data-parallel ranks, which must be {ep}; got {self.dp.size}")
        pp = c.pipeline_model_parallel_size
        if pp > 1 and getattr(model, "num_stages", None) != pp:
            raise ValueError(f"pipeline_model_parallel_size {pp}: split the model into its {pp} stages first "
                             "(lockstep.dist.pipeline_parallel.split_model) and drive this rank's stage through "
                             "lockstep.dist.pipeline_parallel (PipelineTrainer, as `lockstep train "
                             "--pipeline-model-parallel-size` does)")
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)

    def _prepare_dtype(self) -> dict[str, torch.Tensor]:
        """Cast to bf16 when configured; returns the fp32 values the optimiser's masters start from."""
        if self.config.dtype != "bfloat16":
            return {}
        if self.ref_model is not None:
            cast_model(self.ref_model, torch.bfloat16)
        if self.sharded:  # FSDP's MixedPrecisionPolicy casts the gathered copies; the shards are the masters
            return {}
        fp32 = {n: p.detach().float().clone() for n, p in self.model.named_parameters() if p.dtype != torch.bfloat16}
        cast_model(self.model, torch.bfloat16)
        cast = {n for n, p in self.model.named_parameters() if p.dtype == torch.bfloat16}
        return {n: v for n, v in fp32.items() if n in cast}

    def _named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in self.model.named_parameters():
            yield canonical_name(name), p

    # ---- forward --------------------------------------------------------------------------

    def _routing(self, mb: MicroBatch, samples: Sequence[Sample]):
        if not self.config.use_rollout_routing_replay:
            return None
        return replay_routing(self.model, mb, samples, self.device, always_forward=self.dp.enabled)

    def _ref_logprobs(self, mb: MicroBatch, routing) -> torch.Tensor:
        ref_routing = None
        if routing is not None and accepts(self.ref_model, "routing"):
            ref_routing = type(routing)(forced=routing.forced)
        with torch.no_grad():
            logits = microbatch_logits(self.ref_model, mb, self.device, ref_routing)
            targets = to_device(mb.targets, self.device)
            return token_logprobs(logits, targets, self.config.temperature, self.fused_logprobs)

    def _microbatches(self, samples: Sequence[Sample]) -> list[MicroBatch | None]:
        """The samples' micro-batches, then None for each one another data-parallel rank has more:
        FSDP gathers parameters in every forward, so every rank runs as many (a None runs the
        first micro-batch again, its result unused)."""
        if self.config.pipeline_model_parallel_size > 1:  # the forward needs the other stages
            raise ValueError("pipeline parallel: this Trainer holds one stage; its steps and logprobs run through "
                             "lockstep.dist.pipeline_parallel (pipeline_train_step, pipeline_logprobs)")
        mbs: list[MicroBatch | None] = pack_microbatches(samples, self.config.max_tokens_per_gpu)
        if self.dp.enabled:
            if not samples:
                raise ValueError(f"data-parallel rank {self.dp.rank} got no samples; every rank needs one")
            mbs += [None] * (self.dp.max_ints([len(mbs)], "micro-batch count")[0] - len(mbs))
        return mbs

    def _padding_forward(self, mb: MicroBatch, samples: Sequence[Sample]) -> None:
        """A forward whose result is unused: this rank's share of the other ranks' collectives."""
        microbatch_logits(self.model, mb, self.device, self._routing(mb, samples))

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Per-sample [R_i] float32 (CPU) logprobs of the response tokens under the current weights."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        mbs = self._microbatches(samples)
        for mb in mbs:
            if mb is None:
                self._padding_forward(mbs[0], samples)
                continue
            logits = microbatch_logits(self.model, mb, self.device, self._routing(mb, samples))
            targets = to_device(mb.targets, self.device)
            logp = token_logprobs(logits, targets, self.config.temperature, self.fused_logprobs)
            for i, lp in zip(mb.indices, mb.split_responses(logp.cpu())):
                out[i] = lp
        return out

    @torch.no_grad()
    def routed_experts(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Experts of the positions predicting each response token (P - 1 + t, as the engine records
        them) in the trainer's forward, [R_i, L, k] per sample."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        mbs = self._microbatches(samples)
        for mb in mbs:
            if mb is None:
                self._padding_forward(mbs[0], samples)
                continue
            routing = self._routing(mb, samples) or Routing()
            microbatch_logits(self.model, mb, self.device, routing)
            for i, experts in zip(mb.indices, response_experts(routing, mb)):
                out[i] = experts
        return out

    # ---- loss -----------------------------------------------------------------------------

    def _normalisers(self, samples: Sequence[Sample]) -> dict:
        c = self.config
        max_len = c.rollout_max_response_len or max(s.response_len for s in samples)
        num_tokens = float(sum(int(s.loss_mask.sum()) for s in samples))
        # samples with a valid token: the denominator of the sample-mean metrics (mismatch.py)
        valid = float(sum(int(s.loss_mask.any()) for s in samples))
        if self.dp.enabled:  # the global batch's counts: every rank divides by the same numbers
            num_tokens, num_samples, valid = self.dp.sum_floats([num_tokens, len(samples), valid], "loss normalisers")
            max_len = self.dp.max_ints([max_len], "max response length")[0]
        else:
            num_samples = len(samples)
        return {"num_tokens": num_tokens, "num_samples": int(num_samples), "max_len": max_len, "valid_samples": valid}

    def _microbatch_loss(self, mb: MicroBatch, samples, norms, old_logprobs, logits: torch.Tensor | None = None):
        """(loss to backward, detached stats, trainer logprobs before the update [T_r]). `logits`: the
        micro-batch's [T_r, V] computed elsewhere (a pipeline's last stage, lockstep.dist.pipeline_parallel;
        no routing replay nor reference model there yet); None: this model's forward."""
        c, dev = self.config, self.device
        routing = None
        if logits is None and self.graphs is not None:  # no routing replay with graphs (TrainConfig)
            logp, entropy = self.graphs(mb, dev)
        else:
            if logits is None:
                routing = self._routing(mb, samples)
                logits = microbatch_logits(self.model, mb, dev, routing)
            logp, entropy = token_logprobs_and_entropy(logits, to_device(mb.targets, dev), c.temperature,
                                                       with_entropy_grad=c.entropy_coef > 0, fused=self.fused_logprobs)
            del logits
        mask, cu = to_device(mb.loss_mask, dev, mb.loss_mask.dtype), mb.response_cu_seqlens
        rollout = mb.gather([s.rollout_logprobs for s in samples], dev)
        before = mb.gather(old_logprobs, dev) if old_logprobs is not None else logp.detach()
        old = rollout if c.use_rollout_logprobs else before
        advantages = mb.gather([s.token_advantages() for s in samples], dev)
        is_weights = None
        if c.importance_sampling:
            is_weights = importance_weights_only(before, rollout, mask, cu, **self._is_config())
        log_ratio = gspo_log_ratio(logp, old, mask, cu) if c.advantage_estimator == "gspo" else logp - old
        pg = ppo_policy_loss(log_ratio, advantages, eps_clip=c.eps_clip, eps_clip_high=c.clip_high,
                             clip_c=c.dual_clip_c, is_weights=is_weights)

        def agg(values: torch.Tensor) -> torch.Tensor:  # the loss terms: the configured aggregation
            return aggregate(values, mask, cu, c.aggregation, num_tokens=norms["num_tokens"],
                             num_samples=norms["num_samples"], max_len=norms["max_len"])

        def token_mean(values: torch.Tensor) -> torch.Tensor:
            # diagnostics are fractions / means per token whatever the loss aggregation (a constant
            # dr_grpo normaliser would report a fully clipped batch as < 1); summed over micro-batches
            # with the global token count they are the step's token means
            return aggregate(values.detach(), mask, cu, "token_mean", num_tokens=norms["num_tokens"])

        pg_loss = agg(pg.loss)
        loss = pg_loss - c.entropy_coef * agg(entropy) if c.entropy_coef > 0 else pg_loss
        stats = {"train/pg_loss": pg_loss.detach(), "train/entropy": token_mean(entropy),
                 "train/pg_clipfrac": token_mean(pg.clipfrac), "train/ppo_kl": token_mean(pg.ppo_kl),
                 # Miles' ois: pi_theta / pi_old, a sample mean like the other ratio metrics
                 "train/ois": aggregate(metric_ratio(-pg.ppo_kl), mask, cu, "sequence_mean",
                                        num_samples=norms["valid_samples"])}
        if c.dual_clip_c is not None:
            stats["train/dual_clipfrac"] = token_mean(pg.dual_clipfrac)
        if self.ref_model is not None:
            kl = agg(kl_penalty(logp, self._ref_logprobs(mb, routing), c.kl_loss_type))
            loss = loss + c.kl_loss_coef * kl
            stats["train/kl_loss"] = kl.detach()
        stats["train/loss"] = loss.detach()
        return loss, stats, before

    def _is_config(self) -> dict:
        """The TIS / MIS settings as importance_weights' keyword arguments."""
        c = self.config
        if c.use_tis:
            return dict(level="token", mode="truncate", lower=c.tis_clip_low, upper=c.tis_clip,
                        veto_threshold=c.veto_threshold)
        return dict(level=c.mis, mode=c.mis_mode, lower=c.mis_lower, upper=c.mis_upper, veto_threshold=c.veto_threshold)

    # ---- step -----------------------------------------------------------------------------

    def forward_backward(self, samples: Sequence[Sample],
                         old_logprobs: Sequence[torch.Tensor] | None = None) -> dict[str, float]:
        """Accumulate the gradient of the step's loss over micro-batches (no optimiser step).
        Returns the loss metrics; `train/loss_finite` is 1.0 or 0.0."""
        return self._loss_metrics(*self._accumulate(samples, old_logprobs))

    def _accumulate(self, samples: Sequence[Sample], old_logprobs: Sequence[torch.Tensor] | None):
        """forward_backward's work with nothing read back: the arguments of `_loss_metrics` (the
        micro-batches' summed loss stats where they were computed; the logprobs before the update as
        host copies queued behind the backward, read after a sync: `_loss_metrics`' first read is one)."""
        if not samples:
            raise ValueError("train_step needs at least one sample")
        self.model.train()
        norms = self._normalisers(samples)
        mbs = self._microbatches(samples)
        totals: dict[str, torch.Tensor] = {}
        before: list[torch.Tensor | None] = [None] * len(samples)
        for i, mb in enumerate(mbs):
            if i == 1 and self.graphs is not None:  # the first one's gradients are a graph's buffers
                detach_grads(self.model.parameters())
            if mb is None:  # a zero-weight pass: this rank's share of FSDP's collectives, no gradient
                (self._microbatch_loss(mbs[0], samples, norms, old_logprobs)[0] * 0.0).backward()
                continue
            loss, stats, mb_before = self._microbatch_loss(mb, samples, norms, old_logprobs)
            loss.backward()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            for i, lp in zip(mb.indices, mb.split_responses(to_host_async(mb_before))):
                before[i] = lp
        self.dp.sum_grads(p for p in self.model.parameters() if not isinstance(p, DTensor))
        return totals, samples, before, norms, sum(mb is not None for mb in mbs)

    def _loss_metrics(self, totals: dict[str, torch.Tensor], samples: Sequence[Sample], before: list[torch.Tensor],
                      norms: dict, num_microbatches: int) -> dict[str, float]:
        """forward_backward's metrics from the micro-batches' summed loss stats and the logprobs before the
        update (also a pipeline's last stage, lockstep.dist.pipeline_parallel)."""
        totals["train/num_microbatches"] = torch.tensor(float(num_microbatches))
        metrics = {k: float(v) for k, v in self.dp.sum_tensors(totals).items()}
        metrics.update(self._mismatch_metrics(samples, before))
        metrics["train/loss_finite"] = float(math.isfinite(metrics["train/loss"]))
        metrics["train/num_tokens"] = norms["num_tokens"]
        return metrics

    def _mismatch_metrics(self, samples: Sequence[Sample], before: list[torch.Tensor]) -> dict[str, float]:
        rollout = [s.rollout_logprobs for s in samples]
        masks = [s.loss_mask for s in samples]
        if self.dp.enabled:  # per-sample metrics over the global batch, samples in rank order
            ranks = self.dp.gather_tensors(before, rollout, masks)
            before, rollout, masks = ([x for r in ranks for x in r[j]] for j in range(3))
        metrics = mismatch_metrics(before, rollout, masks)
        if self.config.importance_sampling:
            flat_before, cu = pack(before)
            rollout_flat, masks_flat = pack(rollout)[0], pack(masks)[0]
            metrics.update(importance_weights(flat_before, rollout_flat, masks_flat, cu, **self._is_config())[1])
        return metrics

    def train_step(self, samples: Sequence[Sample],
                   old_logprobs: Sequence[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimiser step on `samples` (advantages filled in). Returns DESIGN.md-named metrics.
        The update is queued before anything is read back (its skip decided on the device), so on a
        GPU the host issues the optimiser while the backward still runs; the metrics are read after."""
        work = self._accumulate(samples, old_logprobs)
        totals, norms = work[0], work[3]
        loss = totals["train/loss"].detach().reshape(())
        if self.dp.enabled:  # every rank skips alike
            loss = self.dp.sum(loss.clone().to(self.dp.device), "the loss's finiteness").to(loss.device)
        pending = self.optimizer.launch(self.config.clip_grad, skip=self._skip_update(loss, norms["num_tokens"]))
        return self._finish_step(self._loss_metrics(*work), pending)

    def optimiser_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """train_step after forward_backward (`metrics` its metrics, completed and returned): clip, step
        (skipped when the loss is not finite or no token counts), count the step."""
        skip = self._skip_update(metrics["train/loss"], metrics["train/num_tokens"])
        return self._finish_step(metrics, self.optimizer.launch(self.config.clip_grad, skip=skip))

    @staticmethod
    def _skip_update(loss: float | torch.Tensor, num_tokens: float) -> bool | torch.Tensor:
        """No update when no token counts or the step's loss (a float, or a tensor where it was
        computed: the answer stays there) is not finite."""
        if not num_tokens > 0:
            return True
        return ~torch.isfinite(loss) if isinstance(loss, torch.Tensor) else not math.isfinite(loss)

    def _finish_step(self, metrics: dict[str, float], pending) -> dict[str, float]:
        """The launched update's result read back into the metrics; the step counted."""
        grad_norm, stepped = self.optimizer.finish(pending)
        nonfinite = not (metrics["train/loss_finite"] and math.isfinite(grad_norm))
        self.num_steps += int(stepped)
        metrics.update({"train/grad_norm": grad_norm, "train/skipped": float(not stepped),
                        "train/skipped_nonfinite": float(nonfinite), "train/lr": self.optimizer.lr,
                        "train/step": float(self.num_steps)})
        return metrics

    # ---- weights and checkpoints ----------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(state-dict name, tensor) for every parameter and persistent buffer that defines the policy
        (e.g. tid2eid, e_score_correction_bias), unquantised, in the model's dtype, detached, in the
        model's state-dict order."""
        for name, t in self._weights.items():  # `.data`: detached already
            yield name, self._full(name, t) if isinstance(t, DTensor) else t  # others as they are

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of each tensor `named_weights` yields, in its order, gathering nothing (a
        sharded tensor's shape is the full one): what a receiver allocates before the tensors come."""
        return [(name, tuple(t.shape), self._full_dtype(name, t)) for name, t in self._weights.items()]

    def _full(self, name: str, t: DTensor) -> torch.Tensor:
        """An FSDP / EP shard -> the full tensor (a collective: every rank iterates named_weights), in
        `_full_dtype`."""
        return gather_full(t).to(self._full_dtype(name, t))

    def _full_dtype(self, name: str, t: torch.Tensor) -> torch.dtype:
        """A shard's full tensor is in the dtype it computes in (what cast_model gives a single-process
        bf16 run); any other tensor keeps its own."""
        if isinstance(t, DTensor) and self.config.dtype == "bfloat16" and t.is_floating_point():
            return storage_dtype(self.model, name, torch.bfloat16)
        return t.dtype

    def save(self, directory: str | Path) -> None:
        """Write weights, optimiser state, RNG states and the step counter into `directory`.
        Data parallel: every rank calls it (the shards are gathered); the files are the one-process
        checkpoint (consolidated, written by rank 0, loadable by any rank count) plus each other
        rank's RNG state (`checkpointing.trainer_file`)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        weights = self.named_weights()
        if self.dp.rank == 0:
            ckpt.save_weights(weights, d / ckpt.WEIGHTS)
            torch.save(self.optimizer.state_dict(), d / ckpt.OPTIMIZER)
        else:  # the gathers are collectives: run them with rank 0, one tensor at a time, keeping none
            drain(itertools.chain(weights, self.optimizer.state_entries()))
        ckpt.save_trainer_state(d / ckpt.trainer_file(self.dp.rank), self.num_steps, self.config.to_dict())
        self.dp.barrier("checkpoint saved")

    def load(self, directory: str | Path, rank: int | None = None) -> list[str]:
        """Restore what `save` wrote (into this trainer's existing model and optimiser); each rank
        takes its shard of every tensor. A pipeline stage (pipeline_model_parallel_size > 1) takes its
        own tensors and returns the file's other names (PipelineTrainer.load checks that some stage
        took each); `rank`: whose RNG file to read, default this data-parallel rank's."""
        d = Path(directory)
        targets = ((n, _ShardTarget(t)) if isinstance(t, DTensor) else (n, t) for n, t in self._weights.items())
        others = ckpt.load_weights(targets, d / ckpt.WEIGHTS, partial=self.config.pipeline_model_parallel_size > 1)
        # mmap: a pipeline stage reads only its own parameters' state out of the whole model's
        self.optimizer.load_state_dict(torch.load(d / ckpt.OPTIMIZER, weights_only=False, mmap=True))
        own = d / ckpt.trainer_file(self.dp.rank if rank is None else rank)
        self.num_steps = int(ckpt.load_trainer_state(own if own.exists() else d / ckpt.TRAINER)["num_steps"])
        return others


class _ShardTarget:
    """A sharded parameter as a `checkpointing.load_weights` target: copying a full tensor in keeps
    this rank's part."""

    def __init__(self, param: torch.Tensor):
        self.param = param

    def copy_(self, full: torch.Tensor) -> None:
        self.param.to_local().copy_(local_part(full, self.param))
