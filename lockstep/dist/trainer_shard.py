"""`TrainerShard`: the Trainer seam for a loop that hands every data-parallel rank the whole batch.

The loop (lockstep/rl/loop.py) is written for one process: it calls `train_step(samples)` with a
step's samples and `logprobs(samples)` with the rollout's. In a data-parallel run every rank holds
the same gathered batch (lockstep/dist/replicas.py), and the FSDP trainer
(`Trainer(..., data_parallel=DataParallel(group))`) wants each rank's own samples. This wrapper
cuts them: rank r of the trainer group takes block r of the samples (`replicas.shard`: contiguous,
sizes differing by at most one), so the global batch is the ranks' blocks in rank order, and the
Trainer's cross-rank sums make the step the step of one process on all of them (train/trainer.py).
`logprobs` gathers the blocks back into the batch's order, so `old[step slice]` means what it means
in one process. Weights (`named_weights`: full tensors, a collective on every rank), `save`,
`load` and the config pass through.

Disaggregated (ranks [0, T) train, [T, N) serve), every rank still runs the loop: an engine-only rank
holds `TrainerShard(None, ctx, config)`, whose `train_step` returns the step's metrics broadcast from
the first trainer rank (the loop decides on them whether to push), whose `named_weights` is None
(push_weights takes the engine's side there) and whose save / load write and read nothing.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from lockstep.dist.replicas import shard


class TrainerShard:
    """Each data-parallel rank trains its block of the batch (module docstring)."""

    def __init__(self, trainer, ctx=None, config=None):
        self.trainer, self.ctx = trainer, ctx
        self.dp = trainer.dp if trainer is not None else None
        self._config = trainer.config if trainer is not None else config
        # disaggregated: the engine-only ranks learn each step's metrics from the first trainer rank
        self._share = ctx is not None and not ctx.layout.is_colocated

    @property
    def config(self):
        return self._config

    def _mine(self, samples) -> slice:
        if len(samples) < self.dp.size:
            raise ValueError(f"data-parallel rank {self.dp.rank}: a train step got {len(samples)} samples for "
                             f"{self.dp.size} trainer ranks; every rank needs at least one (fewer "
                             f"--num-steps-per-rollout, or more samples per rollout)")
        return shard(len(samples), self.dp.size, self.dp.rank)

    def logprobs(self, samples) -> list:
        """Per-sample logprobs of the whole batch, in its order (each rank computes its block)."""
        if self.trainer is None:
            return [None] * len(samples)
        with self._computing("the logprob forward"):
            local = self.trainer.logprobs(samples[self._mine(samples)])
        return [t for (block,) in self.dp.gather_tensors(local) for t in block]

    def train_step(self, samples, old_logprobs=None) -> dict[str, float]:
        metrics = None
        if self.trainer is not None:
            mine = self._mine(samples)
            with self._computing("the train step"):
                metrics = self.trainer.train_step(samples[mine],
                                                  old_logprobs=old_logprobs[mine] if old_logprobs else None)
        return self._shared(metrics) if self._share else metrics

    def _computing(self, what: str):
        """The trainer's own computation, whose collectives (FSDP's) fail named (groups.computing)."""
        return self.ctx.computing(f"{what} (the trainers' collectives inside)") if self.ctx else contextlib.nullcontext()

    def _shared(self, metrics):
        box = [metrics]
        with self.ctx.collective("broadcast_object_list of the train step's metrics"):
            dist.broadcast_object_list(box, src=self.ctx.weight_src, group=self.ctx.control_group)
        return box[0]

    def named_weights(self):
        return self.trainer.named_weights() if self.trainer is not None else None

    def save(self, directory) -> None:
        if self.trainer is not None:
            self.trainer.save(directory)

    def load(self, directory) -> None:
        if self.trainer is not None:
            self.trainer.load(directory)
