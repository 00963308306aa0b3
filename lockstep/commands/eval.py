"""`lockstep eval`: pass@k of a model on held-out sets (no training).

    lockstep eval --model DIR --eval-data math500 ../shared/data/math500/test.jsonl
Each set is scored by its own reward, as in `lockstep train` (RunConfig.eval_data: NAME:RM, else the
data set's checker, here math-verify, else --rm-type). With no --model and no --eval-data: the
embedded tiny model on the arithmetic task's held-out "eval" split.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli_args import add_dataclass_arguments, dataclass_from_args
from ..config import EngineConfig
from ..files import FileError
from ..rl.config import RunConfig
from ..rl.embedded import ENGINE_RECIPE, RUN_RECIPE
from .presets import PROMPT_ROOM, default_text, engine_preset, preset

RUN_FIELDS = ("model", "eval_data", "eval_temperature", "eval_max_response_len", "n_samples_per_eval_prompt",
              "eval_prompts_limit", "rm_type", "custom_reward_path", "input_key", "label_key", "apply_chat_template",
              "skip_bad_rows", "max_prompt_len", "seed")
MAX_MODEL_LEN = f"{PROMPT_ROOM} + --eval-max-response-len"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dataclasses import fields

    add_dataclass_arguments(parser, RunConfig, skip=tuple(f.name for f in fields(RunConfig) if f.name not in RUN_FIELDS),
                            default_text=default_text(RunConfig, RUN_RECIPE))
    add_dataclass_arguments(parser, EngineConfig, skip=("eos_token_ids",), group="rollout engine",
                            default_text=default_text(EngineConfig, ENGINE_RECIPE, {"max_model_len": MAX_MODEL_LEN}))
    parser.add_argument("--output", help="also write the metrics as JSON to this file (default: print only)")
    parser.add_argument("--plot", help="also draw each set's pass@k against k into this PNG file")


def run(args) -> int:
    from ..engine.engine import Engine
    from ..rl import eval_report as report
    from ..rl.evaluate import evaluate_set
    from ..rl.progress import prompts_bar
    from ..rl.rollout import RolloutSpec
    from ..rl.long_prompts import check_room
    from ..rl.setup import eval_sets, left_out_lines, model_path

    for flag, out in (("--output", args.output), ("--plot", args.plot)):  # before the evaluation, not after it
        if out and not Path(out).resolve().parent.is_dir():
            raise FileError(f"{flag} {out}: its directory does not exist")
    cfg = dataclass_from_args(RunConfig, args, **preset(args, RUN_RECIPE))
    engine_cfg = dataclass_from_args(EngineConfig, args, **engine_preset(args, cfg.eval_max_response_len))
    path = model_path(cfg)
    if cfg.max_prompt_len:
        check_room(cfg.max_prompt_len, engine_cfg.max_model_len)
    engine = Engine.from_pretrained(path, engine_cfg)
    print(f"model {path} ({engine_cfg.device}, {engine_cfg.dtype}, serving {engine_cfg.serving_format})")
    spec = RolloutSpec(cfg.n_samples_per_eval_prompt, cfg.eval_temperature, 1.0, cfg.eval_max_response_len,
                       cfg.apply_chat_template, cfg.seed)
    data = {name: file for name, file, _ in cfg.eval_sets}
    metrics, warnings = {}, []
    sets, left_out = eval_sets(cfg, tokenizer=engine.tokenizer)
    for line in left_out_lines(left_out):
        print(line)
    for name, eval_set in sets.items():
        print(report.set_header(name, data.get(name, "the embedded task's held-out split"), eval_set, spec))
        with prompts_bar(name, len(eval_set.prompts)) as tick:
            result = evaluate_set(engine, name, eval_set, spec, on_prompt_done=tick)
        print(report.set_footer(name, result))
        print("\n".join(report.sample_lines(eval_set, result, spec.n_samples)))
        metrics.update(result.metrics)
        warnings.append(report.reward_warning(name, eval_set, result))
    for k, v in sorted(metrics.items()):
        print(f"{k:40s} {v:.4f}")
    for warning in filter(None, warnings):  # last, where they are seen
        print(warning, file=sys.stderr)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(metrics, f, indent=1)
    if args.plot:
        from ..metrics.plots import plot_pass_at_k

        print(f"pass@k plot: {plot_pass_at_k(metrics, args.plot)}")
    return 0
