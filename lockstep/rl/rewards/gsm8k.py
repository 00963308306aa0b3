"""GSM8K reward: the last number in the response equals the number after "####" in the label.

    gold = text after the last "####" in the label (the whole label if there is none)
    pred = last number in the response (optional sign, digits with "," separators, optional decimals)
    reward = 1.0 if float(pred) == float(gold) after stripping commas, "$" and spaces, else 0.0

GSM8K answers are integers (e.g. "#### 1,080"), so an exact float comparison is safe; "18.00" and
"18" are equal.
"""

from __future__ import annotations

import re

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _to_float(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def gold_answer(label: str) -> str:
    return label.rsplit("####", 1)[-1].strip()


def last_number(text: str) -> str | None:
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def reward(response: str, label: str) -> float:
    gold = _to_float(gold_answer(str(label)))
    pred_text = last_number(response)
    if gold is None or pred_text is None:
        return 0.0
    pred = _to_float(pred_text)
    return 1.0 if pred is not None and pred == gold else 0.0
