"""`lockstep train --use-rollout-routing-replay` end to end: the rollout records each token's
experts and the trainer replays them (issue 14 item 5: it used to crash on routed_experts None)."""

from lockstep.cli import main
from lockstep.metrics.sinks import read_metrics


def test_train_with_routing_replay_runs_three_rollouts(tmp_path):
    args = ["train", "--num-rollout", "3", "--use-rollout-routing-replay", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--eval-interval", "10", "--eval-prompts-limit", "2",
            "--n-samples-per-eval-prompt", "2", "--run-dir", str(tmp_path), "--no-plot"]
    assert main(args) == 0
    steps = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}
    for step in (1, 2, 3):
        # fp32 on the CPU with the engine's own routing: the two sides agree to rounding
        assert steps[step]["train/train_rollout_logprob_abs_diff"] < 1e-5
