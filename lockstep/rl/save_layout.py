"""A `--save` directory's layout, and how a save commits: a run killed mid-save keeps its last save.

    DIR/loop_state.json         the loop's state; "step_dir" names the save's directory below
    DIR/step-N-XXXXXXXX/        one save (N: rollouts done; XXXXXXXX: random, so no save reuses a name)
        trainer/                the trainer's checkpoint (lockstep/train/checkpointing.py), every rank's files
        rng.pt                  the loop's torch RNG state

Every rank writes the save into DIR/step-N.saving/; once the trainer's closing barrier says every rank's
files are in, the primary renames it to its final name and then replaces loop_state.json atomically:
that replacement is the commit. Before it, loop_state.json still names the previous save, untouched;
after it the previous save's directory is removed. Nothing else in DIR is touched (it may be the run
directory). A save of the older layout (trainer/ and rng.pt in DIR itself, no "step_dir") still loads.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
from pathlib import Path

from ..files import FileError, read_json, write_atomically

STATE_FILE = "loop_state.json"
_SAVE = re.compile(r"step-\d+-[0-9a-f]{8}")
_STAGING = re.compile(r"step-\d+\.saving")


def staging(directory: Path, step: int) -> Path:
    """Where every rank writes the save after `step` rollouts (the name is the same on every rank)."""
    return directory / f"step-{step}.saving"


def begin(directory: Path, step: int, primary: bool) -> Path:
    """The staging directory of this save, made; the primary first removes what killed saves left (not
    this save's: another rank may be writing it already)."""
    if primary and directory.is_dir():
        for stale in directory.iterdir():
            if _STAGING.fullmatch(stale.name) and stale != staging(directory, step):
                shutil.rmtree(stale, ignore_errors=True)
    path = staging(directory, step)
    path.mkdir(parents=True, exist_ok=True)
    return path


def commit(directory: Path, step: int, state: dict) -> None:
    """Make the staged save the directory's save (the primary, after every rank's files are in)."""
    final = directory / f"step-{step}-{secrets.token_hex(4)}"
    staging(directory, step).rename(final)
    write_atomically(directory / STATE_FILE, json.dumps({**state, "step_dir": final.name}, indent=1,
                                                        default=str).encode())
    for old in directory.iterdir():  # superseded saves, this layout's and the older one's
        if (_SAVE.fullmatch(old.name) and old != final) or (old.name == "trainer" and old.is_dir()):
            shutil.rmtree(old)
    (directory / "rng.pt").unlink(missing_ok=True)


def read(directory: Path) -> tuple[dict, Path]:
    """(the loop's state, the directory holding trainer/ and rng.pt) of the save in `directory`."""
    path = directory / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--load {directory}: no {STATE_FILE} (not a lockstep save directory)")
    state = read_json(path)
    base = directory / state.get("step_dir", ".")
    if not (base / "trainer").is_dir():
        raise FileError(f"{path}: field step_dir: {base} holds no trainer/ (the save's files were moved or removed)")
    return state, base
