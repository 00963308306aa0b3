"""Metric sinks: where per-step metric dicts go.

JsonlSink (always on) appends one JSON object per `log` call to RUN_DIR/metrics.jsonl, with the step
under "step", and flushes at once, so a crashed or killed run keeps every step it logged and a
resumed run continues the same file: `rewind(step)` first moves the records of the steps it will redo
(those after its save) and a line cut short by a kill to metrics.jsonl.rewound, so each step is in
the file once and nothing is deleted. Values are converted to plain floats / ints (tensors, numpy
scalars); non-finite floats (NaN, inf) are written as null so that the file stays strict JSON.

TensorBoardSink and WandbSink import their package only when constructed and raise a
MissingDependencyError naming the pip package if it is absent; nothing else in lockstep imports them.

`read_metrics(path)` reads the file back; a malformed line raises MetricsFileError naming the file
and the 1-based line number, except a last line without its newline (a write the kill cut short),
which is left out.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from lockstep.files import write_atomically

METRICS_FILE = "metrics.jsonl"


class MissingDependencyError(ImportError):
    """An optional sink was requested but its package is not installed."""


class MetricsFileError(ValueError):
    """metrics.jsonl is missing or malformed; the message names the file (and line)."""


def to_jsonable(value: Any) -> Any:
    """Scalar tensors / numpy scalars -> Python numbers; non-finite floats -> None."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric value of type {type(value).__name__} is not a scalar")


class JsonlSink:
    def __init__(self, run_dir: str | Path, filename: str = METRICS_FILE):
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        record = {"step": int(step)}
        record.update({k: to_jsonable(v) for k, v in metrics.items() if k != "step"})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def rewind(self, step: int) -> int:
        """Before a resumed run logs: the file's tail of records after `step` and of lines a kill cut
        short moves to RUN_DIR/metrics.jsonl.rewound (appended). Only the tail: earlier lines, e.g. an
        earlier run's in the same directory, stay. Returns the number of lines moved."""
        lines = _lines(self.path)
        keep = len(lines)
        while keep and not _at_or_before(lines[keep - 1], step):
            keep -= 1
        if keep == len(lines):
            return 0
        with open(f"{self.path}.rewound", "a", encoding="utf-8") as moved:
            moved.writelines(line if line.endswith("\n") else line + "\n" for line in lines[keep:])
        self._file.close()
        write_atomically(self.path, "".join(lines[:keep]).encode("utf-8"))  # a kill: the old file or the new
        self._file = self.path.open("a", encoding="utf-8")
        return len(lines) - keep

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lines(path: Path) -> list[str]:
    """The file's lines, each with its "\n" but a last one cut short (split at "\n" only: str.splitlines
    would also split inside a JSON string holding U+2028)."""
    *whole, last = path.read_text(encoding="utf-8").split("\n")
    return [line + "\n" for line in whole] + ([last] if last else [])


def _at_or_before(line: str, step: int) -> bool:
    """A whole line (newline-terminated) holding a record of a step <= `step`."""
    try:
        record = json.loads(line) if line.endswith("\n") else None
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step


class TensorBoardSink:
    def __init__(self, run_dir: str | Path, subdir: str = "tensorboard"):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise MissingDependencyError(
                "the TensorBoard sink needs the 'tensorboard' package: pip install tensorboard "
                "(or pip install 'lockstep-rl[tensorboard]')"
            ) from e
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / subdir))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in metrics.items():
            value = to_jsonable(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, run_dir: str | Path, project: str = "lockstep", name: str | None = None, config: dict | None = None):
        try:
            import wandb
        except ImportError as e:
            raise MissingDependencyError(
                "the W&B sink needs the 'wandb' package: pip install wandb (or pip install 'lockstep-rl[wandb]')"
            ) from e
        self._wandb = wandb
        self._run = wandb.init(project=project, name=name, dir=str(run_dir), config=config or {})

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._run.log({k: to_jsonable(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MultiSink:
    """Fans one log call out to several sinks."""

    def __init__(self, sinks: Sequence[Any]):
        self.sinks = list(sinks)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def rewind(self, step: int) -> int:
        """JsonlSink.rewind (TensorBoard and W&B keep what they were sent: they show a step logged twice
        by its latest value)."""
        return sum(sink.rewind(step) for sink in self.sinks if isinstance(sink, JsonlSink))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def make_sinks(run_dir: str | Path, tensorboard: bool = False, wandb: bool = False, wandb_project: str = "lockstep") -> MultiSink:
    sinks: list[Any] = [JsonlSink(run_dir)]
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    if wandb:
        sinks.append(WandbSink(run_dir, project=wandb_project))
    return MultiSink(sinks)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file, in order; blank lines and a last line a kill cut short skipped."""
    path = Path(path)
    if not path.is_file():
        raise MetricsFileError(f"{path}: metrics file not found")
    lines = _lines(path)
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not line.endswith("\n"):
                break  # the last write of a killed run, cut short
            raise MetricsFileError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise MetricsFileError(f"{path}, line {lineno}: expected an object with an integer 'step'")
        records.append(record)
    return records
