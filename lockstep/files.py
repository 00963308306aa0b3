"""Files a user hands lockstep (config.json, tokenizer files, GGUF, prompt sets): errors that name them.

The one rule: a file that cannot be used raises `FileError`, a ValueError whose message starts with
the file's path, then the field or line, then why ("DIR/config.json: field hidden_size: must be an
int, got '576'"). lockstep/cli.py prints any ValueError as one line and exits 2 (set
LOCKSTEP_TRACEBACK=1 for the traceback), so readers only have to raise it.

Config dataclasses raise `FieldError(owner, field, why)` ("DeepseekV4Config.hidden_size: ...");
code that builds one from a file wraps the build in `naming(path)`, which turns it into the
FileError above. `check_types` catches what JSON gets wrong and dataclasses do not check: a
string or a float where a size is meant (otherwise a torch traceback deep inside the model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


class FileError(ValueError):
    """A file cannot be used; the message starts with its path."""


class FieldError(ValueError):
    """A config field holds a bad value; str() is "Owner.field: why"."""

    def __init__(self, owner: str, field: str, why: str):
        super().__init__(f"{owner}.{field}: {why}")
        self.field, self.why = field, why


def _utf8(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise FileError(f"{path}: line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}: {e.reason})") from None


def read_json(path: str | Path) -> Any:
    """The parsed JSON of `path`; missing, unreadable or malformed: FileError naming the file (and the
    line and column)."""
    path = Path(path)
    if not path.is_file():
        raise FileError(f"{path}: file not found" if not path.exists() else f"{path}: not a file")
    text = _utf8(path, path.read_bytes())
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        why = e.msg.removesuffix(" at")  # "Invalid control character at": the position follows
        raise FileError(f"{path}: line {e.lineno} column {e.colno}: invalid JSON: {why}") from None


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Errors raised while building something from `path` name it (FieldError: "PATH: field X: why")."""
    try:
        yield
    except FileError:
        raise
    except FieldError as e:
        raise FileError(f"{path}: field {e.field}: {e.why}") from e
    except KeyError as e:  # from_hf_dict reading a required key
        raise FileError(f"{path}: missing field {e.args[0]!r}") from e
    except (ValueError, TypeError) as e:
        raise FileError(f"{path}: {e}") from e


# annotation name -> accepted Python types (bool is an int in Python, never a size here)
_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "dict": (dict,),
          "None": (type(None),), "list": (list,), "tuple": (tuple, list)}


def _allowed(annotation: str) -> tuple[type, ...] | None:
    """Types an annotation string such as "int | list[int] | None" accepts; None: not checked."""
    out: list[type] = []
    for part in annotation.split("|"):
        base = part.strip().split("[")[0]
        if base not in _TYPES:
            return None
        out += _TYPES[base]
    return tuple(out)


def check_types(cls, values: dict[str, Any]) -> None:
    """Each of `values` that names a field of dataclass `cls` holds its annotated type, else FieldError."""
    annotations = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, value in values.items():
        allowed = _allowed(str(annotations.get(name, "")))
        if allowed is None or value is None:  # None: from_hf_dict's "use the default"
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise FieldError(cls.__name__, name, f"must be {str(annotations[name])}, got {value!r}")


def check_positive(owner: str, values: dict[str, Any]) -> None:
    """Sizes and counts are >= 1 (a negative layer count otherwise surfaces as an 'unexpected tensor')."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise FieldError(owner, name, f"must be >= 1, got {value}")


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all: a temporary file in the same directory, then a
    rename (a reader, or a process killed mid-write, never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
