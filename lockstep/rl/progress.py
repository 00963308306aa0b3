"""A rich progress bar over rollouts showing the latest reward, abs diff and eval pass@1."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RunProgress:
    def __init__(self, total: int):
        self.total = total
        self.bar = Progress(TextColumn("[bold]rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        self.task = None

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
        parts += [f"{k.split('/')[1]} p@1 {v:.3f}" for k, v in metrics.items() if k.endswith("/pass@1")]
        self.bar.update(self.task, completed=step, info="  ".join(parts))
