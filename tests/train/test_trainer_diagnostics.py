"""Loss diagnostics are token means over the whole step whatever the loss aggregation (issue 14
item 13: under dr_grpo's constant normaliser a fully clipped batch reported pg_clipfrac 0.375)."""

from __future__ import annotations

import math

import pytest

from lockstep.train.config import TrainConfig
from lockstep.train.trainer import Trainer
from tests.train.trainer_fixtures import make_samples, tiny_model


def _step(loss_agg: str, old_shift: float = 1.0):
    trainer = Trainer(tiny_model(), TrainConfig(loss_agg=loss_agg, rollout_max_response_len=16, max_tokens_per_gpu=16))
    samples = make_samples(6)
    for s in samples:
        s.advantages = 1.0
    # pi_old below pi_theta by a factor e: ratio 2.7 > 1 + eps_clip on every token, A > 0 -> clipped
    old = [lp - old_shift for lp in trainer.logprobs(samples)]
    return trainer.forward_backward(samples, old_logprobs=old)


def test_fully_clipped_batch_reports_clipfrac_one_under_dr_grpo():
    metrics = _step("dr_grpo")
    assert metrics["train/num_microbatches"] > 1  # the token mean is global over micro-batches
    assert metrics["train/pg_clipfrac"] == pytest.approx(1.0)
    assert metrics["train/ppo_kl"] == pytest.approx(-1.0, abs=1e-5)


@pytest.mark.parametrize("loss_agg", ["sequence", "dr_grpo"])
def test_diagnostics_equal_token_aggregation(loss_agg):
    ref, other = _step("token", 0.1), _step(loss_agg, 0.1)
    for name in ("train/entropy", "train/pg_clipfrac", "train/ppo_kl"):
        assert other[name] == pytest.approx(ref[name], rel=1e-5), name
    if loss_agg == "dr_grpo":  # the loss keeps its aggregation: sum / (6 samples x 16 tokens)
        assert other["train/pg_loss"] == pytest.approx(ref["train/pg_loss"] * ref["train/num_tokens"] / 96, rel=1e-5)


def test_ois_is_pi_theta_over_pi_old():
    # Miles' train/ois = exp(logp - old_logp); here old = logp - 1 on every token, over micro-batches
    metrics = _step("token")
    assert metrics["train/ois"] == pytest.approx(math.e, rel=1e-5)
    assert _step("token", 0.0)["train/ois"] == pytest.approx(1.0)
