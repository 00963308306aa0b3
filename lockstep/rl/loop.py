"""The synchronous RL loop; `RLRun.run` reads as the algorithm:

    for each rollout id:
        samples  = generate (engine) + reward (+ dynamic-sampling filter)
        samples += group advantages
        train num_steps_per_rollout optimizer steps on the samples
        push the new weights into the engine (re-quantised to its serving format)
        evaluate every eval_interval, save every save_interval, log one metrics line
        (with each phase's peak memory: metrics/phase_memory.py)

The rollout's samples are split into num_steps_per_rollout nearly equal consecutive slices (sizes
differ by at most one; every sample is trained on). A non-finite loss or gradient makes the trainer
skip that step (counted in train/skipped_steps); the weights are pushed whenever at least one step
of the rollout changed them, so the engine never serves a policy older than the trainer's.

On N processes (lockstep/rl/data_parallel.py) every rank runs this same loop: the engine is the
world's replicas (each generates its block of the requests, every rank gets all samples), the
trainer each rank's FSDP shard, so rewards, advantages and filter decisions are computed on the same
batch everywhere. Only the primary process (rank 0) writes metrics, progress and the run state;
the phases' peak memory of every rank reaches it through `gather` (perf/memory/rankR/..., and the
largest over the ranks under the plain names).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .evaluate import evaluate
from ..metrics.phase_memory import PhaseMemory, per_rank
from ..metrics.sinks import make_sinks
from .advantages import compute_advantages
from . import save_layout
from .config import RunConfig
from .rollout import RolloutSpec, generate_rollout


def step_slices(num_samples: int, num_steps: int) -> list[slice]:
    """Consecutive slices covering all samples, sizes differing by at most one (larger first); a
    step with no sample gets no slice. E.g. 10 samples, 3 steps -> [0:4], [4:7], [7:10]."""
    base, extra = divmod(num_samples, num_steps)
    out, start = [], 0
    for i in range(num_steps):
        size = base + (i < extra)
        if size:
            out.append(slice(start, start + size))
        start += size
    return out


@dataclass
class RLRun:
    config: RunConfig
    engine: object  # lockstep.engine.Engine
    trainer: object  # lockstep.train.Trainer
    source: object  # lockstep.rl.data.PromptSource
    reward_fn: object
    eval_sets: dict = field(default_factory=dict)  # name -> EvalSet (each scored by its own reward)
    run_dir: Path = Path("runs/default")
    advantage_estimator: str = "grpo"
    rollout_id: int = 0
    progress: object = None  # callable(rollout_id, metrics) for progress display
    start_metrics: dict = field(default_factory=dict)  # logged with the first line (e.g. data/skipped_rows)
    primary: bool = True  # writes metrics and run state; False on ranks other than 0 of a multi-process run
    device: str = "cpu"  # whose memory the phases' peaks measure (this process's GPU, or its RSS on a CPU)
    gather: object = None  # on N processes: callable(dict) -> every rank's dict, in rank order (every rank calls it)

    def __post_init__(self):
        c = self.config
        # routing replay trains on the experts the engine chose, so the rollout must record them
        self.spec = RolloutSpec(c.n_samples_per_prompt, c.rollout_temperature, c.rollout_top_p,
                                c.rollout_max_response_len, c.apply_chat_template, c.seed,
                                routed_experts=self.trainer.config.use_rollout_routing_replay)
        self.eval_spec = RolloutSpec(c.n_samples_per_eval_prompt, c.eval_temperature, 1.0,
                                     c.eval_max_response_len, c.apply_chat_template, c.seed)
        self.sinks = make_sinks(self.run_dir, tensorboard=c.tensorboard, wandb=c.wandb) if self.primary else None
        self.memory = PhaseMemory(self.device)

    # ---- the algorithm ------------------------------------------------------------------

    def run(self) -> None:
        c = self.config
        if self.rollout_id == 0 and self.eval_sets:
            self.log(self.evaluate(), step=0)
        phase = self.memory.phase
        while self.rollout_id < c.num_rollout:
            with phase("rollout"):
                samples, metrics = self.generate()
            self.add_advantages(samples)
            with phase("train"):
                metrics.update(self.train(samples))
            if metrics["train/optimizer_steps"] > 0:
                with phase("weight_sync"):
                    metrics.update(self.sync_weights())
            self.rollout_id += 1
            if self.eval_sets and (self.rollout_id % c.eval_interval == 0 or self.rollout_id == c.num_rollout):
                with phase("eval"):
                    metrics.update(self.evaluate())
            metrics.update(self.memory_metrics())
            # logged before the save: a saved step always has its record (a kill between the two then
            # leaves a record the resumed run rewinds and redoes, instead of a step with none)
            self.log(metrics, step=self.rollout_id)
            due = c.save_interval and self.rollout_id % c.save_interval == 0 or self.rollout_id == c.num_rollout
            if c.save and due:
                self.save(c.save)
        if self.sinks is not None:
            self.sinks.close()

    # ---- the steps ----------------------------------------------------------------------

    def generate(self):
        c = self.config
        return generate_rollout(self.engine, self.source, self.reward_fn, batch_size=c.rollout_batch_size,
                                spec=self.spec, rollout_id=self.rollout_id, dynamic_sampling=c.dynamic_sampling,
                                max_rounds=c.max_sampling_rounds)

    def add_advantages(self, samples) -> None:
        if not samples:
            return
        adv = compute_advantages(self.advantage_estimator, torch.tensor([s.reward for s in samples]),
                                 group_ids=[s.group_id for s in samples],
                                 token_counts=[int(s.loss_mask.sum()) for s in samples])
        for s, a in zip(samples, adv.tolist()):
            s.advantages = a

    def train(self, samples) -> dict[str, float]:
        """num_steps_per_rollout optimiser steps over consecutive slices of `samples`. Metrics are the
        mean over the steps run (empty slices are not run), plus train/optimizer_steps (steps that
        changed the weights) and train/skipped_steps (steps run but skipped, e.g. non-finite)."""
        start = time.perf_counter()
        steps = self.config.num_steps_per_rollout
        # with several steps, pi_old is the policy before the first of them (PPO's ratio and clip)
        old = self.trainer.logprobs(samples) if steps > 1 and samples else None
        runs = []
        for sl in step_slices(len(samples), steps):
            runs.append(self.trainer.train_step(samples[sl], old_logprobs=old[sl] if old else None))
        totals = {k: sum(float(m[k]) for m in runs) / len(runs) for k in runs[0]} if runs else {}
        skipped = sum(int(m["train/skipped"]) for m in runs)
        if runs:  # a counter, not a quantity to average
            totals["train/step"] = float(runs[-1]["train/step"])
        totals.update({"train/optimizer_steps": float(len(runs) - skipped), "train/skipped_steps": float(skipped),
                       "perf/train_time": time.perf_counter() - start})
        return totals

    def sync_weights(self) -> dict[str, float]:
        start = time.perf_counter()
        pushed = self.engine.update_weights(self.trainer.named_weights(), version=self.engine.weight_version + 1)
        # a push over torch.distributed reports its own metrics (bytes); the time is the loop's view
        return {**(pushed or {}), "perf/weight_sync_time": time.perf_counter() - start}

    def evaluate(self) -> dict[str, float]:
        start = time.perf_counter()
        metrics = evaluate(self.engine, self.eval_sets, self.eval_spec, tag=("eval", self.rollout_id))
        metrics["perf/eval_time"] = time.perf_counter() - start
        return metrics

    def memory_metrics(self) -> dict[str, float]:
        """This step's peak memory per phase: this process's, or on N processes every rank's."""
        mine = self.memory.metrics()
        return per_rank(self.gather(mine)) if self.gather is not None else mine

    def log(self, metrics: dict, step: int) -> None:
        metrics, self.start_metrics = {**self.start_metrics, **metrics}, {}
        if self.sinks is None:
            return
        self.sinks.log(metrics, step=step)
        if self.progress is not None:
            self.progress(step, metrics)

    # ---- resume -------------------------------------------------------------------------

    def save(self, directory) -> None:
        """Staged, then committed (save_layout.py): a run killed mid-save keeps its previous save."""
        d = Path(directory)
        part = save_layout.begin(d, self.rollout_id, self.primary)
        self.trainer.save(part / "trainer")  # every rank: a data-parallel save gathers the shards
        if not self.primary:
            return
        torch.save({"torch_rng": torch.get_rng_state()}, part / "rng.pt")
        state = {"rollout_id": self.rollout_id, "weight_version": self.engine.weight_version,
                 "data": self.source.state_dict()}
        save_layout.commit(d, self.rollout_id, state)  # trainer.save ended in a barrier: every rank's files are in

    def load(self, directory) -> None:
        state, base = save_layout.read(Path(directory))
        self.trainer.load(base / "trainer")
        self.source.load_state_dict(state["data"])
        self.rollout_id = int(state["rollout_id"])
        torch.set_rng_state(torch.load(base / "rng.pt")["torch_rng"])
        # the engine serves exactly the restored weights, under the saved version number
        self.engine.update_weights(self.trainer.named_weights(), version=int(state["weight_version"]))
        if self.sinks is not None:  # the steps after the save are redone: their old records move aside
            self.sinks.rewind(self.rollout_id)
