"""The progress display's eval line: pass@1, pass@n and the truncated ratio of every eval set."""

from lockstep.rl.progress import RunProgress, eval_line


def test_eval_line_has_pass_at_1_and_n_and_truncated_ratio_per_set():
    metrics = {f"eval/math500/pass@{k}": k / 10 for k in range(1, 9)}
    metrics.update({"eval/math500/truncated_ratio": 0.25, "eval/gsm8k/pass@1": 0.5, "rollout/raw_reward": 0.3})
    assert eval_line(metrics) == "math500 p@1 0.100 p@8 0.800 trunc 0.250  gsm8k p@1 0.500"
    assert eval_line({"rollout/raw_reward": 0.3}) == ""


def test_progress_keeps_the_last_eval_line_between_evals():
    with RunProgress(3) as progress:
        progress.start(0)
        progress.update(1, {"rollout/raw_reward": 0.5, "eval/a/pass@1": 0.25, "eval/a/pass@2": 0.5,
                            "eval/a/truncated_ratio": 0.0})
        progress.update(2, {"rollout/raw_reward": 0.75})
        info = progress.bar.tasks[0].fields["info"]
    assert info == "reward 0.75  eval a p@1 0.250 p@2 0.500 trunc 0.000"
