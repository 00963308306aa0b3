"""Reward functions: `fn(response: str, label: str) -> float`, one file per reward.

    dapo        text after the last "Answer:", normalised, string-equal to the label   (1.0 / 0.0)
    math        last \\boxed{...} checked against the label with math-verify           (1.0 / 0.0)
    gsm8k       last number in the response == the number after "####" in the label   (1.0 / 0.0)
    arithmetic  integer after the last "Answer:" (else the last integer) == label      (1.0 / 0.0)
    "pkg.mod:fn" or "path/to/file.py:fn"   a custom function, loaded by `load_custom_reward`

Eval sets are scored by their data set's own checker, not the training reward: `natural_reward`
maps a set's name (else its file path) to the reward it was built for (MATH-500, AIME -> math;
GSM8K -> gsm8k; DAPO -> dapo; the synthetic set -> arithmetic); RunConfig.eval_sets applies it.

All built-in rewards are 0/1 so that `rollout/raw_reward` reads as accuracy and pass@k can use the
same numbers. `safe_reward` wraps any of them so an exception (a custom reward's bug, a parser
blow-up on a pathological response) scores 0 and is counted instead of killing the run.
"""

from __future__ import annotations

import importlib
import importlib.util
# Not `import math`: importing the submodule lockstep.rl.rewards.math rebinds that package attribute.
from math import isfinite
from pathlib import Path
from typing import Callable

RewardFn = Callable[[str, str], float]

BUILTIN_REWARDS = ("dapo", "math", "gsm8k", "arithmetic")

# data set name prefix (lower case, "-" / "_" / spaces dropped) -> the checker its answers are written for
NATURAL_REWARDS = {"math500": "math", "aime": "math", "amc": "math", "gsm8k": "gsm8k", "dapo": "dapo",
                   "arithmetic": "arithmetic"}


def natural_reward(name: str, path: str = "") -> str | None:
    """The built-in reward of a known data set, from its name ("math500", "AIME-2024", "gsm8k_test"),
    else from its path's file stem or directory (".../math500/test.jsonl"); None if none names a known
    set. Directories further up are not read: /home/amcgill/... is no AMC set."""
    file = Path(path)
    for word in (name, file.stem, file.parent.name) if path else (name,):
        key = "".join(c for c in word.lower() if c not in "-_ ")
        for prefix, reward in NATURAL_REWARDS.items():
            if key.startswith(prefix):
                return reward
    return None


def load_custom_reward(spec: str) -> RewardFn:
    """Load "package.module:function" (importable) or "path/to/file.py:function"."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"custom reward must be given as 'module:function', got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"custom reward file not found: {path}")
        mod_spec = importlib.util.spec_from_file_location(f"lockstep_custom_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:  # the module, or one it imports: a user's input, one line (lockstep/cli.py)
            raise ValueError(f"custom reward {spec!r}: cannot import {module_name}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"custom reward {spec!r}: {module_name} has no callable {attr!r}")
    return fn


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward by name (BUILTIN_REWARDS), or a custom one if `name` contains ':'."""
    if ":" in name:
        return load_custom_reward(name)
    if name not in BUILTIN_REWARDS:
        raise ValueError(f"unknown reward {name!r}; choose one of {BUILTIN_REWARDS} or give 'module:function'")
    return importlib.import_module(f"lockstep.rl.rewards.{name}").reward


def safe_reward(fn: RewardFn, response: str, label: str) -> tuple[float, bool]:
    """(reward, error_flag): 0.0 and True if fn raises or returns something that is not a finite number."""
    try:
        value = float(fn(response, label))
    except Exception:  # noqa: BLE001 - any failure of a reward must not stop training
        return 0.0, True
    if not isfinite(value):
        return 0.0, True
    return value, False


def score_all(fn: RewardFn, responses: list[str], labels: list[str]) -> tuple[list[float], int]:
    """safe_reward over a batch; returns (rewards, number of errors)."""
    results = [safe_reward(fn, r, l) for r, l in zip(responses, labels, strict=True)]
    return [r for r, _ in results], sum(e for _, e in results)
