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

Worked solutions (`worked_pairs`, for + and -): the same problems, selected by the same rule
(`_distinct_problems`, hence the same splits), with the column method written out before the
answer: SFT data with real structure for the `lockstep sft --preset` models.
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


def _distinct_problems(n: int, seed: int, digits: int, operators: Sequence[str], allow_negative: bool,
                       split: str | None) -> list[tuple[int, str, int]]:
    """The first n distinct (a, op, b) of `split` among draws 0, 1, 2, ... of `seed`: the one
    selection rule every prompt and worked-solution set of this module goes through."""
    _check(digits, operators, split)
    seen: set[tuple[int, str, int]] = set()
    out = []
    for i in range(MAX_DRAWS_PER_PROMPT * n):
        if len(out) == n:
            return out
        problem = _draw(i, seed, digits, operators, allow_negative)
        if problem in seen or (split is not None and problem_split(*problem) != split):
            continue
        seen.add(problem)
        out.append(problem)
    if len(out) < n:
        raise ValueError(f"arithmetic_prompts: found only {len(out)} distinct problems of split {split!r} in "
                         f"{MAX_DRAWS_PER_PROMPT * n} draws, {n} asked for (digits={digits}, operators={list(operators)})")
    return out


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
    problems = _distinct_problems(n, seed, digits, operators, allow_negative, split)
    return [Prompt(prompt=f"What is {a} {op} {b}?", label=str(OPERATORS[op](a, b)), index=i, source="arithmetic")
            for i, (a, op, b) in enumerate(problems)]


def worked_solution(a: int, op: str, b: int) -> str:
    """The column method written out, least significant digit first, one line per column, then
    "Answer: N" (what the arithmetic reward reads). For a - b, a >= b. E.g. 58 + 67:

        8+7+0=15 c1
        5+6+1=12 c1
        Answer: 125

    and 52 - 17: "2-7-0+10=5 b1", "5-1-1=3 b0", "Answer: 35". Every line is checkable arithmetic,
    so a model must learn carries and borrows rather than a digit-pattern lookup."""
    if op not in ("+", "-") or (op == "-" and a < b) or min(a, b) < 0:
        raise ValueError(f"worked_solution covers a + b and a - b with a >= b >= 0, got {a} {op} {b}")
    da, db = str(a)[::-1], str(b)[::-1]
    lines, carry = [], 0  # carry: the carry of + or the borrow of -, into the next column
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        lines.append(_column(x, op, y, carry))
        carry = int(lines[-1][-1])
    lines.append(f"Answer: {OPERATORS[op](a, b)}")
    return "\n".join(lines)


def _column(x: int, op: str, y: int, carry: int) -> str:
    """One column's line; its last character is the carry / borrow it passes on."""
    if op == "+":
        total = x + y + carry
        return f"{x}+{y}+{carry}={total} c{total // 10}"
    diff = x - y - carry
    return f"{x}-{y}-{carry}+10={diff + 10} b1" if diff < 0 else f"{x}-{y}-{carry}={diff} b0"


def worked_pairs(n: int, seed: int = 0, digits: int = 4, operators: Sequence[str] = ("+", "-"),
                 split: str | None = None) -> list[tuple[str, str]]:
    """(question, worked_solution) of the same problems, in the same order, as
    arithmetic_prompts(n, seed, digits, operators, split=split): SFT targets whose splits are
    those of the prompts the reward scores."""
    problems = _distinct_problems(n, seed, digits, operators, False, split)
    return [(f"What is {a} {op} {b}?", worked_solution(a, op, b)) for a, op, b in problems]
