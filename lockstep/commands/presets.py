"""Which defaults a `lockstep train` / `lockstep eval` run gets, and what `--help` says about them.

    no --model    the embedded tiny DeepSeek-V4's preset (lockstep/rl/embedded.py RUN_RECIPE,
                  TRAIN_RECIPE, ENGINE_RECIPE) over the config classes' defaults
    --model DIR   the config classes' own defaults (real-run values, after Miles' DeepSeek-V4 run),
                  and an engine context sized for the run: max_model_len = PROMPT_ROOM + the
                  longest response the run samples
A flag given on the command line always wins over both.
"""

from __future__ import annotations

import dataclasses

from ..rl.embedded import ENGINE_RECIPE

# Prompt tokens the engine's context leaves room for when --max-model-len is not given. Measured
# with the SmolLM2 tokenizer and chat template: DAPO-Math-17k median 106, max 1602 (first 3,000
# rows); MATH-500 median 82, max 943. The engine caps it at the model's max_position_embeddings.
PROMPT_ROOM = 2048


def is_embedded(args) -> bool:
    return not getattr(args, "model", "")


def preset(args, recipe: dict) -> dict:
    """The recipe's values of the fields not given as flags, when the run is the embedded one."""
    return {k: v for k, v in recipe.items() if k not in vars(args)} if is_embedded(args) else {}


def engine_preset(args, *response_lens: int) -> dict:
    """EngineConfig values set by the preset: the embedded recipe, or with --model a max_model_len
    that holds a prompt and the longest of `response_lens`."""
    if is_embedded(args):
        return preset(args, ENGINE_RECIPE)
    if "max_model_len" in vars(args):
        return {}
    return {"max_model_len": PROMPT_ROOM + max(response_lens)}


def default_text(cls, recipe: dict, with_model: dict[str, str] | None = None) -> dict[str, str]:
    """--help's shown default of each field the presets set: the value with --model, then the
    embedded one; `with_model` replaces the first where it is derived from other flags."""
    with_model = {**{f.name: f.default for f in dataclasses.fields(cls)}, **(with_model or {})}
    return {k: f"{with_model[k]} with --model; {v} without (the embedded preset)"
            for k, v in recipe.items() if with_model[k] != v}


def describe(args) -> str:
    """One line saying which defaults this run got."""
    if is_embedded(args):
        return "defaults: the embedded preset (lockstep/rl/embedded.py); flags given override it"
    return "defaults: the real-model defaults (lockstep train --help); flags given override them"
