"""Synthetic arithmetic prompts for the embedded default run (no data download needed).

A problem is "What is {a} {op} {b}?" with the integer result as its label, e.g. "What is 23 + 58?"
-> "81". Draw i of a seed comes from random.Random(f"{seed}:{i}"), so a seed gives the same
problems on every machine and Python version (string seeds are hashed with SHA-512).

Splits. Every problem belongs to exactly one split of SPLITS ("train", "select" = the SFT
warm start's model-selection set, "eval"), decided by a hash of the problem itself
(`problem_split`), never by the seed: with two-digit additions there are only 8,100 problems, so
sets drawn from different seeds overlap, while sets drawn from different splits cannot, whatever
their seeds and sizes. `a op b` and `b op a` share a split for + and *, so a held-out 58 + 23 was
not trained on as 23 + 58 either. `arithmetic_prompts(n, split=...)` is the first n distinct
problems of the split in the seed's order (a set of n is a prefix of the set of n + 1).

Difficulty knobs (defaults): digits = 2 (operands have exactly `digits` digits; 1 allows 0..9),
operators = ("+", "-") (any of "+", "-", "*"), allow_negative = False (for "-", the operands are
ordered so the result is >= 0). The reward is `lockstep.rl.rewards.arithmetic`.
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence

from lockstep.rl.data import Prompt

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
COMMUTATIVE = ("+", "*")
# share of the problem space in each split; 10% of two-digit additions is ~810 problems
SPLITS = {"train": 0.8, "select": 0.1, "eval": 0.1}
# arithmetic_prompts gives up after this many draws per prompt asked for (the split is too small)
MAX_DRAWS_PER_PROMPT = 100


def problem_split(a: int, op: str, b: int) -> str:
    """The split of SPLITS that problem `a op b` belongs to (a pure function of the problem)."""
    key = f"{min(a, b)} {op} {max(a, b)}" if op in COMMUTATIVE else f"{a} {op} {b}"
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64  # uniform in [0, 1)
    upper = 0.0
    for name, share in SPLITS.items():
        upper += share
        if u < upper:
            return name
    return name  # u within float rounding of 1.0: the last split


def _check(digits: int, operators: Sequence[str], split: str | None) -> None:
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    unknown = [op for op in operators if op not in OPERATORS]
    if unknown or not operators:
        raise ValueError(f"operators must be a non-empty subset of {list(OPERATORS)}, got {list(operators)}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)} (or None for all problems), got {split!r}")


def _draw(index: int, seed: int, digits: int, operators: Sequence[str], allow_negative: bool) -> tuple[int, str, int]:
    rng = random.Random(f"{seed}:{index}")
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    hi = 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    op = operators[rng.randrange(len(operators))]
    if op == "-" and not allow_negative and a < b:
        a, b = b, a
    return a, op, b


def arithmetic_problem(
    index: int, seed: int = 0, digits: int = 2, operators: Sequence[str] = ("+", "-"), allow_negative: bool = False
) -> tuple[str, int]:
    """(question, answer) of draw `index` (of any split)."""
    _check(digits, operators, None)
    a, op, b = _draw(index, seed, digits, operators, allow_negative)
    return f"What is {a} {op} {b}?", OPERATORS[op](a, b)


def arithmetic_prompts(
    n: int,
    seed: int = 0,
    digits: int = 2,
    operators: Sequence[str] = ("+", "-"),
    allow_negative: bool = False,
    split: str | None = None,
) -> list[Prompt]:
    """The first n distinct problems of `split` (None: of any split) among draws 0, 1, 2, ... of
    `seed`, as plain-string prompts with integer labels as strings; Prompt.index is the position."""
    _check(digits, operators, split)
    seen: set[str] = set()
    out = []
    for i in range(MAX_DRAWS_PER_PROMPT * n):
        if len(out) == n:
            return out
        a, op, b = _draw(i, seed, digits, operators, allow_negative)
        question = f"What is {a} {op} {b}?"
        if question in seen or (split is not None and problem_split(a, op, b) != split):
            continue
        seen.add(question)
        out.append(Prompt(prompt=question, label=str(OPERATORS[op](a, b)), index=len(out), source="arithmetic"))
    if len(out) < n:
        raise ValueError(f"arithmetic_prompts: found only {len(out)} distinct problems of split {split!r} in "
                         f"{MAX_DRAWS_PER_PROMPT * n} draws, {n} asked for (digits={digits}, operators={list(operators)})")
    return out
