"""MATH reward: the last \\boxed{...} of the response, checked against the label with math-verify.

    reward = 1.0 if math_verify.verify(parse(\\boxed{label}), parse(\\boxed{pred})) else 0.0
    pred   = content of the last \\boxed{...} in the response (brace-matched); no box -> 0.0

Both sides are wrapped in \\boxed{} so math-verify's LaTeX extraction takes exactly that expression
(labels such as MATH-500's "\\left( 3, \\frac{\\pi}{2} \\right)" are bare LaTeX). Equivalence is
symbolic / numeric (e.g. \\frac{1}{2} == 0.5), as implemented by math-verify.

Hangs: sympy can take unbounded time on adversarial input. math-verify bounds it with
signal.alarm (parsing_timeout / timeout_seconds, here TIMEOUT_S = 5 s), which only works in the
main thread; elsewhere we pass None (math-verify then runs without signals) and rely on the
length cap MAX_ANSWER_CHARS on the extracted answer to keep parsing cheap. Run rewards in the
main thread or in worker processes to keep the hard timeout.
"""

from __future__ import annotations

import logging
import threading

from math_verify import parse, verify

TIMEOUT_S = 5
MAX_ANSWER_CHARS = 1000

# math-verify warns once when its timeout is disabled; we disable it deliberately off the main thread.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), matching nested braces; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    open_at = text.index("{", start)
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1: i]
    return None  # unbalanced (e.g. truncated response)


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def is_equivalent(pred: str, label: str) -> bool:
    timeout = _timeout()
    gold = parse("\\boxed{" + label + "}", parsing_timeout=timeout)
    target = parse("\\boxed{" + pred + "}", parsing_timeout=timeout)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=timeout))


def reward(response: str, label: str) -> float:
    pred = last_boxed(response)
    if pred is None or not pred.strip() or len(pred) > MAX_ANSWER_CHARS:
        return 0.0
    return 1.0 if is_equivalent(pred, str(label)) else 0.0
