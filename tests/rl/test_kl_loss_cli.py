"""`lockstep train --kl-loss-coef > 0` builds the frozen reference model (issue 14 item 6: build_run gave
the trainer none, so every such run raised), for each KL estimator."""

import math

import pytest

from lockstep.cli import main
from lockstep.metrics.sinks import read_metrics
from lockstep.rl.config import RunConfig
from lockstep.rl.embedded import ASSET_DIR
from lockstep.rl.setup import check_ref_load


def _train(run_dir, *extra):
    args = ["train", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--eval-interval", "10", "--eval-prompts-limit", "2", "--n-samples-per-eval-prompt", "2",
            "--kl-loss-coef", "0.1", "--run-dir", str(run_dir), "--no-plot", *extra]
    assert main(args) == 0
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


@pytest.mark.parametrize("kl_type", ["k1", "k2", "low_var_kl"])
def test_kl_loss_runs_from_the_cli(tmp_path, kl_type):
    steps = _train(tmp_path, "--kl-loss-type", kl_type)
    # the reference is the initial policy: no divergence before the first update, some after it
    assert steps[1]["train/kl_loss"] == 0.0
    kl = steps[2]["train/kl_loss"]
    assert math.isfinite(kl) and kl != 0.0
    assert steps[2]["train/skipped_steps"] == 0


def test_ref_load_takes_a_model_directory(tmp_path):
    steps = _train(tmp_path, "--num-rollout", "1", "--ref-load", str(ASSET_DIR))
    assert steps[1]["train/kl_loss"] == 0.0  # the bundled model is the run's initial policy too


def test_ref_load_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--ref-load .*--kl-loss-coef"):
        check_ref_load(RunConfig(ref_load=str(ASSET_DIR)), kl_loss_coef=0.0)
    with pytest.raises(FileNotFoundError, match="--ref-load .*config.json"):
        check_ref_load(RunConfig(ref_load=str(tmp_path)), kl_loss_coef=0.1)
