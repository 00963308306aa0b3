"""Synthetic arithmetic prompts for the embedded default run (no data download needed).

Prompt i of a set is "What is {a} {op} {b}?" with the integer result as its label, e.g.
"What is 23 + 58?" -> "81". Each prompt is drawn from random.Random(f"{seed}:{i}"), so prompt i
does not depend on how many prompts were generated before it, and a seed gives the same set on
every machine and Python version (string seeds are hashed with SHA-512).

Difficulty knobs (defaults): digits = 2 (operands have exactly `digits` digits; 1 allows 0..9),
operators = ("+", "-") (any of "+", "-", "*"), allow_negative = False (for "-", the operands are
ordered so the result is >= 0). The reward is `lockstep.rl.rewards.arithmetic`.
"""

from __future__ import annotations

import random
from typing import Sequence

from lockstep.rl.data import Prompt

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_problem(
    index: int, seed: int = 0, digits: int = 2, operators: Sequence[str] = ("+", "-"), allow_negative: bool = False
) -> tuple[str, int]:
    """(question, answer) of problem `index`."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    unknown = [op for op in operators if op not in OPERATORS]
    if unknown or not operators:
        raise ValueError(f"operators must be a non-empty subset of {list(OPERATORS)}, got {list(operators)}")
    rng = random.Random(f"{seed}:{index}")
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    hi = 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    op = operators[rng.randrange(len(operators))]
    if op == "-" and not allow_negative and a < b:
        a, b = b, a
    return f"What is {a} {op} {b}?", OPERATORS[op](a, b)


def arithmetic_prompts(
    n: int,
    seed: int = 0,
    digits: int = 2,
    operators: Sequence[str] = ("+", "-"),
    allow_negative: bool = False,
    start: int = 0,
) -> list[Prompt]:
    """Prompts start .. start + n - 1 (plain-string prompts, integer labels as strings)."""
    out = []
    for i in range(start, start + n):
        question, answer = arithmetic_problem(i, seed, digits, operators, allow_negative)
        out.append(Prompt(prompt=question, label=str(answer), index=i, source="arithmetic"))
    return out
