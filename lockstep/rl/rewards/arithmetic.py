"""Arithmetic reward, for the synthetic task of `lockstep.rl.arithmetic` (the embedded default).

    pred = the integer right after the last "Answer:" if the response has one,
           else the last integer anywhere in the response
    reward = 1.0 if pred == int(label) else 0.0

The fallback to the last integer lets a tiny model that has not learned the format still earn
reward, which is what gets a from-scratch run off the ground.
"""

from __future__ import annotations

import re

_ANSWER_INT_RE = re.compile(r"(?i)answer\s*:\s*(-?\d+)")
_INT_RE = re.compile(r"-?\d+")


def extract_int(response: str) -> int | None:
    after_answer = _ANSWER_INT_RE.findall(response)
    if after_answer:
        return int(after_answer[-1])
    ints = _INT_RE.findall(response)
    return int(ints[-1]) if ints else None


def reward(response: str, label: str) -> float:
    pred = extract_int(response)
    return 1.0 if pred is not None and pred == int(str(label).strip()) else 0.0
