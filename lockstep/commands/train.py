"""`lockstep train`: RL post-training. With no arguments: GRPO on the embedded tiny
DeepSeek-V4 and synthetic arithmetic, TIS on, on the CPU, plots written at the end."""

from __future__ import annotations

import argparse

from ..cli_args import add_dataclass_arguments, dataclass_from_args
from ..config import EngineConfig
from ..rl.config import RunConfig
from ..rl.embedded import ENGINE_RECIPE, RUN_RECIPE, TRAIN_RECIPE
from .presets import PROMPT_ROOM, default_text, describe, engine_preset, preset

# set from RunConfig instead (one flag per concept)
TRAIN_SHARED = ("temperature", "seed", "rollout_max_response_len")
ENGINE_SHARED = ("dtype", "eos_token_ids", "compile_hc")  # compile_hc: both sides compile mHC alike
MAX_MODEL_LEN = f"{PROMPT_ROOM} + the longer of --rollout-max-response-len and --eval-max-response-len"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..train.config import TrainConfig

    parser.description = (f"{parser.description}. Defaults: without --model the embedded preset "
                          "(lockstep/rl/embedded.py); with --model the real-model values; each flag's "
                          "help shows both where they differ.")
    add_dataclass_arguments(parser, RunConfig, group="run", default_text=default_text(RunConfig, RUN_RECIPE))
    add_dataclass_arguments(parser, TrainConfig, skip=TRAIN_SHARED, group="trainer",
                            default_text=default_text(TrainConfig, TRAIN_RECIPE))
    add_dataclass_arguments(parser, EngineConfig, skip=ENGINE_SHARED, group="rollout engine",
                            default_text=default_text(EngineConfig, ENGINE_RECIPE, {"max_model_len": MAX_MODEL_LEN}))


def configs_from_args(args):
    from ..train.config import TrainConfig

    run = dataclass_from_args(RunConfig, args, **preset(args, RUN_RECIPE))
    train = dataclass_from_args(TrainConfig, args, temperature=run.rollout_temperature, seed=run.seed,
                                rollout_max_response_len=run.rollout_max_response_len,
                                **preset(args, TRAIN_RECIPE))
    engine = dataclass_from_args(EngineConfig, args, dtype=train.dtype, compile_hc=train.compile_hc, **engine_preset(
        args, run.rollout_max_response_len, run.eval_max_response_len))
    return run, train, engine


def run(args) -> int:
    from ..metrics.plots import plot_run
    from ..rl.progress import RunProgress
    from ..rl.setup import build_run

    run_cfg, train_cfg, engine_cfg = configs_from_args(args)
    print(describe(args))
    with RunProgress(run_cfg.num_rollout) as progress:
        rl = build_run(run_cfg, train_cfg, engine_cfg, progress=progress.update)
        progress.start(rl.rollout_id)
        rl.run()
    print(f"metrics: {rl.run_dir / 'metrics.jsonl'}")
    if run_cfg.plot:
        result = plot_run(rl.run_dir)
        print(f"plots: {rl.run_dir / 'plots'}  (reward slope per step: {result['reward_slope']:+.4f})")
    return 0
