"""RLRun.train splits a rollout over num_steps_per_rollout steps without dropping samples, averages
over the steps run, counts skipped steps, and pushes weights when any step changed them (issue 14
item 7: it dropped len % steps samples, averaged empty slices and skipped the push after one bad step)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lockstep.rl.config import RunConfig
from lockstep.rl.loop import RLRun, step_slices
from lockstep.sample import Sample


class FakeTrainer:
    """Records each step's samples; the steps listed in `bad` are skipped as non-finite."""

    def __init__(self, bad=()):
        self.config = SimpleNamespace(use_rollout_routing_replay=False)
        self.seen, self.bad, self.num_steps = [], set(bad), 0

    def logprobs(self, samples):
        return [torch.zeros(1) for _ in samples]

    def train_step(self, samples, old_logprobs=None):
        i = len(self.seen)
        self.seen.append([s.metadata["i"] for s in samples])
        ok = i not in self.bad
        self.num_steps += ok
        return {"train/loss": float(len(samples)) if ok else math.nan, "train/skipped": float(not ok),
                "train/skipped_nonfinite": float(not ok), "train/step": float(self.num_steps)}

    def named_weights(self):
        return iter(())


class FakeEngine:
    weight_version = 0

    def __init__(self):
        self.pushes = 0

    def update_weights(self, named, version):
        self.pushes += 1
        self.weight_version = version


def _samples(n):
    return [Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], advantages=1.0, metadata={"i": i})
            for i in range(n)]


def _run(tmp_path, steps, trainer, n_samples):
    cfg = RunConfig(num_rollout=1, rollout_batch_size=2, n_samples_per_prompt=6, num_steps_per_rollout=steps,
                    run_dir=str(tmp_path))
    rl = RLRun(cfg, FakeEngine(), trainer, source=None, reward_fn=None, run_dir=tmp_path)
    rl.generate = lambda: (_samples(n_samples), {})
    rl.add_advantages = lambda samples: None
    return rl


def test_step_slices_cover_every_sample_nearly_equally():
    assert step_slices(10, 3) == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert step_slices(2, 3) == [slice(0, 1), slice(1, 2)]
    assert step_slices(0, 2) == []


def test_every_sample_trained_and_metrics_averaged_over_steps_run(tmp_path):
    trainer = FakeTrainer()
    rl = _run(tmp_path, 3, trainer, 10)
    metrics = rl.train(_samples(10))
    assert trainer.seen == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]  # the old code dropped sample 9
    assert metrics["train/loss"] == pytest.approx(10 / 3)
    assert metrics["train/optimizer_steps"] == 3 and metrics["train/skipped_steps"] == 0
    assert metrics["train/step"] == 3


def test_fewer_samples_than_steps_averages_only_steps_run(tmp_path):
    trainer = FakeTrainer()
    metrics = _run(tmp_path, 3, trainer, 2).train(_samples(2))
    assert trainer.seen == [[0], [1]]
    assert metrics["train/loss"] == 1.0  # the old code divided by 3 steps


def test_one_bad_step_still_pushes_and_is_counted(tmp_path):
    trainer = FakeTrainer(bad={1})
    rl = _run(tmp_path, 2, trainer, 12)
    rl.run()
    assert rl.engine.pushes == 1  # step 0 changed the weights: the engine must serve them
    from lockstep.metrics.sinks import read_metrics
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["train/skipped_steps"] == 1 and record["train/optimizer_steps"] == 1


def test_no_step_taken_no_push(tmp_path):
    rl = _run(tmp_path, 2, FakeTrainer(bad={0, 1}), 12)
    rl.run()
    assert rl.engine.pushes == 0


def test_add_advantages_weighs_reinforce_pp_by_valid_tokens(tmp_path):
    rl = _run(tmp_path, 1, FakeTrainer(), 3)
    rl.advantage_estimator = "reinforce_pp"
    samples = [Sample(prompt_ids=[1], response_ids=[2] * r, rollout_logprobs=[0.0] * r, loss_mask=m, reward=reward)
               for r, m, reward in ((1, [1], 1.0), (4, [0, 1, 1, 1], 0.0), (2, [1, 1], 0.0))]
    RLRun.add_advantages(rl, samples)  # the class's method (the fixture stubs the instance's out)
    # valid tokens 1, 3, 2: the hand example of tests/rl/test_rl_advantages.py
    assert [s.advantages for s in samples] == pytest.approx([2.0412415, -0.4082483, -0.4082483], abs=1e-5)
