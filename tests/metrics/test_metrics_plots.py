import json

import pytest

from lockstep.cli import main
from lockstep.metrics.plots import eval_curves, least_squares_line, moving_average, plot_run
from lockstep.metrics.sinks import JsonlSink


def test_moving_average_and_least_squares():
    assert moving_average([1, 2, 3, 4], 2).tolist() == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([4, 0, 2], 10).tolist() == [4.0, 2.0, 2.0]
    slope, intercept = least_squares_line([0, 1, 2, 3], [1, 3, 2, 5])
    # mean x 1.5, mean y 2.75; sum dx*dy = 5.5, sum dx^2 = 5
    assert slope == pytest.approx(1.1) and intercept == pytest.approx(2.75 - 1.1 * 1.5)
    assert least_squares_line([2, 2], [1, 3]) == (0.0, 2.0)


def _write_run(run_dir, steps=12):
    with JsonlSink(run_dir) as sink:
        for i in range(steps):
            m = {"rollout/raw_reward": 0.2 + 0.05 * i, "train/train_rollout_logprob_abs_diff": 0.01}
            if i % 4 == 0:
                m.update({"eval/math500/pass@1": 0.1 + 0.01 * i, "eval/math500/pass@4": 0.3 + 0.01 * i})
            sink.log(m, step=i)


def test_plot_command_writes_pngs_and_prints_slope(tmp_path, capsys):
    _write_run(tmp_path)
    assert main(["plot", str(tmp_path), "--window", "3"]) == 0
    out = capsys.readouterr().out
    assert "rollout/raw_reward slope: 0.05 per step" in out
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["eval_math500_pass_at_k.png", "raw_reward.png", "train_rollout_logprob_abs_diff.png"]
    for name in names:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_reward_metric(tmp_path):
    with JsonlSink(tmp_path) as sink:
        sink.log({"train/train_rollout_logprob_abs_diff": 0.02}, step=0)
    result = plot_run(tmp_path)
    assert result["reward_slope"] is None and [p.name for p in result["files"]] == ["train_rollout_logprob_abs_diff.png"]


def test_plot_command_reports_bad_file_and_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 1
    assert "metrics.jsonl: metrics file not found" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{oops\n')
    assert main(["plot", str(tmp_path)]) == 1
    assert f"{tmp_path / 'metrics.jsonl'}, line 3: not valid JSON" in capsys.readouterr().err


def test_eval_plot_has_every_k_and_the_truncated_ratio():
    records = [{"step": 0, **{f"eval/aime/pass@{k}": k / 10 for k in range(1, 11)}, "eval/aime/truncated_ratio": 0.5},
               {"step": 1, "rollout/raw_reward": 0.5},
               {"step": 2, "eval/aime/pass@1": 0.2, "eval/aime/truncated_ratio": 0.25}]
    curves = eval_curves(records)
    assert list(curves["aime"]) == [f"pass@{k}" for k in range(1, 11)] + ["truncated ratio"]  # k in numeric order
    steps, values = curves["aime"]["truncated ratio"]
    assert steps.tolist() == [0.0, 2.0] and values.tolist() == [0.5, 0.25]


def test_compare_draws_other_runs_into_the_same_figures(tmp_path, monkeypatch):
    from lockstep.metrics import plots

    exact, default = tmp_path / "true-on-policy", tmp_path / "default"
    with JsonlSink(exact) as a, JsonlSink(default) as b:
        for i in range(5):
            a.log({"rollout/raw_reward": 0.3, "train/train_rollout_logprob_abs_diff": 0.0}, step=i)
            b.log({"rollout/raw_reward": 0.3, "train/train_rollout_logprob_abs_diff": 2e-7}, step=i)
    drawn = {}
    save = plots._save

    def recording_save(plt, fig, ax, path):
        drawn[path.name] = [(line.get_label(), list(line.get_ydata())) for line in ax.get_lines()]
        return save(plt, fig, ax, path)

    monkeypatch.setattr(plots, "_save", recording_save)
    assert main(["plot", str(exact), "--compare", str(default)]) == 0
    assert drawn["train_rollout_logprob_abs_diff.png"] == [("true-on-policy", [0.0] * 5), ("default", [2e-7] * 5)]
    assert drawn["raw_reward.png"][-1][0] == "default: moving average (10)"
    assert main(["plot", str(exact), "--compare", str(tmp_path / "missing")]) == 1  # the missing file is named


def test_lockstep_eval_plots_pass_at_k_against_k(tmp_path, monkeypatch, capsys):
    from lockstep.metrics import plots

    metrics = {"eval/b/pass@2": 0.5, "eval/a/pass@4": 0.75, "eval/a/pass@1": 0.25, "eval/a/pass@2": 0.5,
               "eval/a/truncated_ratio": 0.1, "eval/b/pass@1": 0.4}
    assert plots.pass_at_k_curves(metrics) == {"a": ([1, 2, 4], [0.25, 0.5, 0.75]), "b": ([1, 2], [0.4, 0.5])}
    drawn = {}
    save = plots._save

    def recording_save(plt, fig, ax, path):
        drawn[path.name] = [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
                            for line in ax.get_lines()]
        return save(plt, fig, ax, path)

    monkeypatch.setattr(plots, "_save", recording_save)
    png = tmp_path / "pass_at_k.png"
    assert main(["eval", "--n-samples-per-eval-prompt", "4", "--eval-max-response-len", "4", "--eval-prompts-limit",
                 "3", "--output", str(tmp_path / "m.json"), "--plot", str(png)]) == 0
    written = json.loads((tmp_path / "m.json").read_text())
    assert drawn["pass_at_k.png"] == [("arithmetic", [1, 2, 3, 4], [written[f"eval/arithmetic/pass@{k}"]
                                                                    for k in range(1, 5)])]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"pass@k plot: {png}" in capsys.readouterr().out
    # a path whose directory is missing is refused before the evaluation runs, not after it
    assert main(["eval", "--plot", str(tmp_path / "no" / "p.png")]) == 2
    assert "--plot" in capsys.readouterr().err and len(drawn) == 1
