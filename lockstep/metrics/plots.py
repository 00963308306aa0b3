"""Plots of a run's metrics.jsonl into RUN_DIR/plots/ (matplotlib, Agg backend: no display needed).

    train_rollout_logprob_abs_diff.png   train/train_rollout_logprob_abs_diff per step
    raw_reward.png                       rollout/raw_reward per step, its trailing moving average
                                         (window W = 10) and the least-squares line y = a + b * step
    eval_<set>_pass_at_k.png             eval/<set>/pass@<k> over steps, one line per k (every k up to
                                         the samples per eval prompt), and eval/<set>/truncated_ratio
                                         (dashed: answers cut at the length limit, scored as wrong)

`lockstep eval --plot FILE` draws its sets' pass@k against k (log-2 axis) into one figure
(`plot_pass_at_k`): how much more often k samples solve a problem than one.

`compare` (`lockstep plot RUN_DIR --compare OTHER_DIR ...`) draws other runs' mismatch and reward
moving average into the same two figures, each labelled by its directory name: e.g. a run with
`--true-on-policy` (0 at every step) beside the same run without it (the gap it closes).

The moving average at step i is the mean of the last min(W, i + 1) points. The least-squares slope
is b = sum((x - mean x)(y - mean y)) / sum((x - mean x)^2) (reward gained per step). A metric
absent from the file simply gets no plot; a missing / malformed file raises MetricsFileError.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from lockstep.metrics.sinks import METRICS_FILE, read_metrics

ABS_DIFF_KEY = "train/train_rollout_logprob_abs_diff"
REWARD_KEY = "rollout/raw_reward"
_EVAL_RE = re.compile(r"^eval/(.+)/pass@(\d+)$")


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that have a numeric value for key."""
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return np.array([p[0] for p in pairs], dtype=float), np.array([p[1] for p in pairs], dtype=float)


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last min(window, i + 1) values at each i."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    v = np.asarray(values, dtype=float)
    csum = np.concatenate([[0.0], np.cumsum(v)])
    idx = np.arange(1, len(v) + 1)
    start = np.maximum(idx - window, 0)
    return (csum[idx] - csum[start]) / (idx - start)


def least_squares_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through (x, y); slope 0 for fewer than 2 distinct x."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) == 0:
        return 0.0, 0.0
    dx = x - x.mean()
    denom = float((dx * dx).sum())
    if denom == 0.0:
        return 0.0, float(y.mean())
    slope = float((dx * (y - y.mean())).sum()) / denom
    return slope, float(y.mean() - slope * x.mean())


def eval_curves(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """{set: {"pass@<k>": (steps, values) for every k present, in k order, then "truncated ratio" if
    eval/<set>/truncated_ratio is present}}: the lines of each set's eval plot."""
    found = {_EVAL_RE.match(k) for r in records for k in r} - {None}
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for m in sorted(found, key=lambda m: (m.group(1), int(m.group(2)))):
        out.setdefault(m.group(1), {})[f"pass@{m.group(2)}"] = series(records, m.group(0))
    for set_name, curves in out.items():
        steps, values = series(records, f"eval/{set_name}/truncated_ratio")
        if len(steps):
            curves["truncated ratio"] = (steps, values)
    return out


def pass_at_k_curves(metrics: dict[str, float]) -> dict[str, tuple[list[int], list[float]]]:
    """{set: (every k, its pass@k), k ascending} of one evaluation's eval/<set>/pass@<k> metrics."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for m in sorted(filter(None, map(_EVAL_RE.match, metrics)), key=lambda m: (m.group(1), int(m.group(2)))):
        ks, values = out.setdefault(m.group(1), ([], []))
        ks.append(int(m.group(2)))
        values.append(metrics[m.group(0)])
    return out


def plot_pass_at_k(metrics: dict[str, float], path: str | Path) -> Path:
    """One evaluation's pass@k against k, a line per set (`lockstep eval --plot`)."""
    plt, fig, ax = _figure("pass@k", "pass@k", xlabel="k (samples per problem)")
    curves = pass_at_k_curves(metrics)
    for set_name, (ks, values) in curves.items():
        ax.plot(ks, values, marker="o", label=set_name)
    ax.set_xscale("log", base=2)
    ticks = sorted({k for ks, _ in curves.values() for k in ks})
    ax.set_xticks(ticks, [str(k) for k in ticks])  # k itself, not 2^i
    ax.set_ylim(0, 1)
    return _save(plt, fig, ax, Path(path))


def _figure(title: str, ylabel: str, xlabel: str = "step"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, ax, path: Path) -> Path:
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(run_dir: str | Path, window: int = 10, compare: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Write the plots; returns {"files": [paths], "reward_slope": float | None}. `compare`: other
    run directories drawn beside this one (module docstring)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS_FILE)
    others = [(Path(d).name, read_metrics(Path(d) / METRICS_FILE)) for d in compare]
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    slope = None

    steps, values = series(records, ABS_DIFF_KEY)
    if len(steps):
        plt, fig, ax = _figure("train/rollout log-prob mismatch", "mean |logp_train - logp_rollout|")
        ax.plot(steps, values, marker=".", label=run_dir.name if others else ABS_DIFF_KEY)
        for name, other in others:
            ax.plot(*series(other, ABS_DIFF_KEY), marker=".", label=name)
        files.append(_save(plt, fig, ax, out_dir / "train_rollout_logprob_abs_diff.png"))

    steps, values = series(records, REWARD_KEY)
    if len(steps):
        slope, intercept = least_squares_line(steps, values)
        plt, fig, ax = _figure("rollout reward", "raw reward")
        ax.plot(steps, values, marker=".", alpha=0.5, label=REWARD_KEY)
        ax.plot(steps, moving_average(values, window), label=f"moving average ({window})")
        ax.plot(steps, intercept + slope * steps, linestyle="--", label=f"least squares, slope {slope:.3g}/step")
        for name, other in others:
            s, v = series(other, REWARD_KEY)
            ax.plot(s, moving_average(v, window), linestyle=":", label=f"{name}: moving average ({window})")
        files.append(_save(plt, fig, ax, out_dir / "raw_reward.png"))

    for set_name, curves in eval_curves(records).items():
        plt, fig, ax = _figure(f"eval {set_name}", "pass@k / truncated ratio")
        for label, (s, v) in curves.items():
            style = dict(color="black", linestyle="--", marker="x") if label == "truncated ratio" else dict(marker="o")
            ax.plot(s, v, label=label, **style)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", set_name)
        files.append(_save(plt, fig, ax, out_dir / f"eval_{safe}_pass_at_k.png"))
    return {"files": files, "reward_slope": slope}
