"""Held out means held out: a training run evaluates only prompts it does not train on.

Public sets overlap: 4 of MATH-500's 500 problems are, word for word, DAPO-Math-17K prompts (the
README's real-data run trains on DAPO-Math and evaluates on MATH-500; measured 2026-12-06 on
../shared/data). A run leaves each held-out set's prompts that are also training prompts out of it
before `--eval-prompts-limit` takes its first N, and says how many (printed, and as
`data/eval_overlap/<set>` in the first metrics line, where any were). Two prompts are the same when
their texts are equal up to whitespace (a chat prompt's text: its messages' contents, in order); a
paraphrase is not caught.
"""

from __future__ import annotations

from .data import Prompt


def prompt_text(prompt: Prompt) -> str:
    """The prompt's words, whitespace collapsed: what makes two prompts the same problem."""
    text = prompt.prompt if isinstance(prompt.prompt, str) else "\n".join(m["content"] for m in prompt.prompt)
    return " ".join(text.split())


def prompt_texts(prompts: list[Prompt]) -> set[str]:
    """The texts of `prompts` (the training set's, made once for every held-out set)."""
    return {prompt_text(p) for p in prompts}


def without_training_prompts(held_out: list[Prompt], train_texts: set[str]) -> tuple[list[Prompt], int]:
    """(the held-out prompts whose text is not in `train_texts`, in order; how many were left out)."""
    kept = [p for p in held_out if prompt_text(p) not in train_texts]
    return kept, len(held_out) - len(kept)
