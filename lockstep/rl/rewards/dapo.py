"""DAPO reward: the text after the last "Answer:" in the response, normalised, compared as a string.

This follows the procedure of DAPO's math_dapo scoring (verl `reward_score/math_dapo.py`, itself
after Minerva's answer normalisation): look only at the last 300 characters of the response, take
the rest of the line after the last case-insensitive "Answer:", normalise it and the ground truth,
and compare the strings. Normalisation here (our own, covering what DAPO's integer answers need):
keep the part after the last "=", unwrap \\boxed{..} / \\text{..} / \\textbf{..}, drop "$", spaces
and TeX spacing (\\! \\, \\; \\quad), degree marks, a trailing ".", thousands separators in a plain
number, and trailing unit words after a number ("12 dollars" -> "12").

Reward 1.0 if equal, else 0.0. DAPO uses -1.0 for wrong; we use 0/1 so that every built-in reward
has one scale (rollout/raw_reward is then accuracy and feeds pass@k directly). GRPO advantages are
unchanged by the affine map r -> 2r - 1 (up to eps); Dr.GRPO / RLOO advantages are scaled by 2,
which the learning rate absorbs.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300
_ANSWER_RE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
_NUMBER_WITH_UNITS_RE = re.compile(r"^(-?\d[\d,]*(?:\.\d+)?)(?:[A-Za-z]+)+$")


def _unwrap(s: str, command: str) -> str:
    """Replace every \\command{inner} with inner, matching nested braces."""
    key = "\\" + command + "{"
    while (start := s.find(key)) >= 0:
        depth, i = 0, start + len(key) - 1
        for i in range(start + len(key) - 1, len(s)):
            depth += {"{": 1, "}": -1}.get(s[i], 0)
            if depth == 0:
                break
        if depth != 0:  # unbalanced: drop the command word, keep the rest
            return s[:start] + s[start + len(key):]
        s = s[:start] + s[start + len(key): i] + s[i + 1:]
    return s


def normalize_answer(answer: str) -> str:
    s = answer.split("=")[-1]
    for command in ("boxed", "text", "textbf", "mathrm", "mbox"):
        s = _unwrap(s, command)
    for junk in ("\\$", "$", "\\!", "\\,", "\\;", "\\quad", "^{\\circ}", "^\\circ", "{,}"):
        s = s.replace(junk, "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if (m := _NUMBER_WITH_UNITS_RE.match(s)) is not None:
        s = m.group(1)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def extract_answer(response: str) -> str | None:
    matches = _ANSWER_RE.findall(response[-TAIL_CHARS:])
    return matches[-1] if matches else None


def reward(response: str, label: str) -> float:
    pred = extract_answer(response)
    if pred is None:
        return 0.0
    gold = normalize_answer(str(label))
    return 1.0 if gold and normalize_answer(pred) == gold else 0.0
