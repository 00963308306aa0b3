"""Prompt data sets (jsonl / parquet) and a resumable, deterministic shuffling cursor.

Rows are dicts. `input_key` names the prompt: a string, or a chat-message list of
{"role": str, "content": str}. `label_key` names the ground truth (str, int or float; stored as
str). Keys may be dotted to reach into nested dicts, e.g. "reward_model.ground_truth" (a literal
key containing the dot wins). `metadata_key` optionally names a dict copied into
`Prompt.metadata`. The shipped sets load as they are:

    dapo_math_17k.parquet   input_key="prompt"   label_key="reward_model.ground_truth"  (chat messages)
    gsm8k test.jsonl        input_key="question" label_key="answer"   (label keeps the "#### n" line)
    math500 test.jsonl      input_key="problem"  label_key="answer"

A malformed row (bad JSON, missing key, wrong type) raises DataError naming the file and the row:
the 1-based line for jsonl, the 0-based row index for parquet. With skip_bad_rows=True it is
skipped instead and counted in `PromptDataset.num_skipped`. Blank jsonl lines are ignored.

PromptSource walks the data set epoch by epoch, each epoch a permutation drawn from
numpy.random.default_rng([seed, epoch]) (identity order with shuffle=False). Its whole state is
(seed, epoch, position), so `load_state_dict(state_dict())` resumes with the next unseen prompt:
no prompt is lost or repeated within an epoch, and a batch may straddle two epochs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np


class DataError(ValueError):
    """A prompt file or one of its rows cannot be used; the message names the file and row."""


@dataclass(frozen=True)
class Prompt:
    prompt: str | list[dict[str, str]]
    label: str
    index: int  # row index in the source file (0-based), stable across shuffles
    source: str = ""  # data set name, e.g. the file stem or the row's data_source
    metadata: dict[str, Any] = field(default_factory=dict)
    where: str = ""  # "FILE, line N" / "FILE, row index N": what an error about this prompt names

    def location(self) -> str:
        return self.where or f"{self.source or 'prompt set'} prompt {self.index}"

    def sample_metadata(self) -> dict[str, Any]:
        """What a Sample's metadata carries: label, data source, index (+ the row's metadata)."""
        return {**self.metadata, "label": self.label, "source": self.source, "index": self.index}


def get_dotted(row: dict, key: str) -> Any:
    """row[key], or row["a"]["b"] for key "a.b"; raises KeyError naming the missing key."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def _check_prompt(value: Any) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise TypeError("prompt must be a string or a non-empty list of {role: str, content: str}")


def _check_label(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"label must be a string or a number, got {type(value).__name__}")
    return str(value)


def row_to_prompt(row: Any, index: int, source: str, input_key: str, label_key: str, metadata_key: str | None,
                  where: str = "") -> Prompt:
    if not isinstance(row, dict):
        raise TypeError(f"row must be a JSON object, got {type(row).__name__}")
    prompt = _check_prompt(get_dotted(row, input_key))
    label = _check_label(get_dotted(row, label_key))
    metadata: dict[str, Any] = {}
    if metadata_key is not None:
        metadata = get_dotted(row, metadata_key)
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be an object, got {type(metadata).__name__}")
    if isinstance(row.get("data_source"), str):
        source = row["data_source"]
    return Prompt(prompt=prompt, label=label, index=index, source=source, metadata=dict(metadata), where=where)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(location, index, row or exception) per non-blank line; index counts non-blank rows."""
    index = 0
    with path.open("rb") as f:  # decoded line by line, so a bad byte is reported with its line
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row: Any = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                row = ValueError(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
            except json.JSONDecodeError as e:
                row = e
            yield f"{path}, line {lineno}", index, row
            index += 1


def _parquet_rows(path: Path, keys: Sequence[str]) -> Iterator[tuple[str, int, Any]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        schema_names = set(pq.read_schema(path).names)
        # Read only the top-level columns the keys touch (dotted keys reach into struct columns).
        columns = sorted({k if k in schema_names else k.split(".")[0] for k in keys} | ({"data_source"} & schema_names))
        columns = [c for c in columns if c in schema_names]
        table = pq.read_table(path, columns=columns)
    except pyarrow.ArrowException as e:  # pyarrow's messages do not name the file
        raise DataError(f"{path}: not a readable parquet file: {e}") from e
    for index, row in enumerate(table.to_pylist()):
        yield f"{path}, row index {index}", index, row


_SPLIT_NAMES = {"train", "test", "validation", "val", "dev", "eval"}


class PromptDataset(Sequence[Prompt]):
    """Prompts of one file, in file order; `num_skipped` counts malformed rows that were skipped."""

    def __init__(
        self,
        path: str | Path,
        input_key: str = "prompt",
        label_key: str = "label",
        metadata_key: str | None = None,
        skip_bad_rows: bool = False,
        source: str | None = None,
    ):
        self.path = Path(path)
        # Split-named files ("test.jsonl") are named after their folder ("gsm8k").
        stem = self.path.stem
        self.source = source or (self.path.parent.name if stem in _SPLIT_NAMES else stem)
        if not self.path.is_file():
            raise DataError(f"{self.path}: prompt file not found")
        keys = [input_key, label_key] + ([metadata_key] if metadata_key else [])
        suffix = self.path.suffix.lower()
        if suffix == ".jsonl":
            rows = _jsonl_rows(self.path)
        elif suffix == ".parquet":
            rows = _parquet_rows(self.path, keys)
        else:
            raise DataError(f"{self.path}: unsupported prompt file type {suffix!r} (use .jsonl or .parquet)")
        self.prompts: list[Prompt] = []
        self.num_skipped = 0
        for where, index, row in rows:
            try:
                if isinstance(row, Exception):
                    raise row
                self.prompts.append(row_to_prompt(row, index, self.source, input_key, label_key, metadata_key,
                                                  where))
            except (KeyError, TypeError, ValueError) as e:  # ValueError: bad JSON or bytes
                if not skip_bad_rows:
                    reason = f"missing key {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
                    raise DataError(f"{where}: {reason}") from e
                self.num_skipped += 1

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i):  # type: ignore[override]
        return self.prompts[i]


class PromptSource:
    """Deterministic epoch-wise shuffling cursor over prompts, resumable via state_dict."""

    def __init__(self, prompts: Sequence[Prompt], seed: int = 0, shuffle: bool = True):
        if len(prompts) == 0:
            raise DataError("PromptSource needs at least one prompt")
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # prompts of the current epoch already handed out
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.prompts)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self, n: int) -> list[Prompt]:
        """The next n prompts, moving into the next epoch (a fresh permutation) when one runs out."""
        batch = []
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(batch), len(self._order) - self.position)
            batch.extend(self.prompts[int(i)] for i in self._order[self.position: self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch, "position": self.position,
                "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != len(self.prompts):
            raise DataError(f"cannot resume: state is for {state['num_prompts']} prompts, data set has {len(self.prompts)}")
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
