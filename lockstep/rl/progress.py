"""Progress bars: `prompts_bar`, the prompts of one set done (lockstep eval); `RunProgress`, a rich
progress bar over rollouts: the latest reward and abs logprob diff, and the last eval line
(also printed above the bar at each eval), per eval set: pass@1, pass@n (n = samples per eval prompt; a reference run's pass@1 / pass@8 with
n = 8) and the truncated ratio (samples cut at the eval length limit, which score as wrong)."""

from __future__ import annotations

import contextlib
import re

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_PASS_RE = re.compile(r"^eval/(.+)/pass@(\d+)$")


def eval_line(metrics: dict) -> str:
    """'<set> p@1 0.273 p@4 0.641 trunc 0.000' per eval set in metrics; '' if there is none."""
    by_set: dict[str, dict[int, float]] = {}
    for key, value in metrics.items():
        m = _PASS_RE.match(key)
        if m:
            by_set.setdefault(m.group(1), {})[int(m.group(2))] = value
    parts = []
    for name, by_k in by_set.items():
        ks = sorted({1, max(by_k)} & set(by_k))
        text = " ".join([name] + [f"p@{k} {by_k[k]:.3f}" for k in ks])
        trunc = metrics.get(f"eval/{name}/truncated_ratio")
        parts.append(text + (f" trunc {trunc:.3f}" if trunc is not None else ""))
    return "  ".join(parts)


class RunProgress:
    def __init__(self, total: int):
        self.total = total
        self.bar = Progress(TextColumn("[bold]rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        self.task = None
        self.last_eval = ""  # kept between evals, which come every eval_interval rollouts

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def start(self, done: int) -> None:
        self.task = self.bar.add_task("rl", total=self.total, completed=done, info="")

    def update(self, step: int, metrics: dict) -> None:
        if self.task is None:
            return
        parts = []
        for key, label in (("rollout/raw_reward", "reward"), ("train/train_rollout_logprob_abs_diff", "|Δlogp|")):
            if key in metrics:
                parts.append(f"{label} {metrics[key]:.3g}")
        line = eval_line(metrics)
        if line:  # each eval also gets a line of its own above the bar, so the history stays on screen
            self.bar.console.print(f"eval after {step} rollouts: {line}")
            self.last_eval = line
        if self.last_eval:
            parts.append(f"eval {self.last_eval}")
        self.bar.update(self.task, completed=step, info="  ".join(parts))


@contextlib.contextmanager
def prompts_bar(name: str, total: int):
    """A bar of the set's prompts done (all of a prompt's samples finished) while the block runs; yields
    its tick. Transient: the set's summary line takes its place."""
    with Progress(TextColumn(f"[bold]{name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task(name, total=total)
        yield lambda: bar.advance(task)
