"""`lockstep train`: RL post-training. With no arguments: GRPO on the embedded tiny
DeepSeek-V4 and synthetic arithmetic, TIS on, on the CPU, plots written at the end."""

from __future__ import annotations

import argparse

from ..cli_args import add_dataclass_arguments, dataclass_from_args
from ..config import EngineConfig
from ..rl.config import RunConfig
from ..rl.embedded import ENGINE_RECIPE, RUN_RECIPE, TRAIN_RECIPE

# set from RunConfig instead (one flag per concept)
TRAIN_SHARED = ("temperature", "seed", "rollout_max_response_len")
ENGINE_SHARED = ("dtype", "eos_token_ids")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..train.config import TrainConfig

    add_dataclass_arguments(parser, RunConfig, group="run")
    add_dataclass_arguments(parser, TrainConfig, skip=TRAIN_SHARED, group="trainer")
    add_dataclass_arguments(parser, EngineConfig, skip=ENGINE_SHARED, group="rollout engine")


def configs_from_args(args):
    from ..train.config import TrainConfig

    embedded = not getattr(args, "model", "")

    def recipe(values: dict) -> dict:  # the embedded default's settings, unless given as flags
        return {k: v for k, v in values.items() if k not in vars(args)} if embedded else {}

    run = dataclass_from_args(RunConfig, args, **recipe(RUN_RECIPE))
    train_defaults, engine_defaults = recipe(TRAIN_RECIPE), recipe(ENGINE_RECIPE)
    train = dataclass_from_args(TrainConfig, args, temperature=run.rollout_temperature, seed=run.seed,
                                rollout_max_response_len=run.rollout_max_response_len, **train_defaults)
    engine = dataclass_from_args(EngineConfig, args, dtype=train.dtype, **engine_defaults)
    return run, train, engine


def run(args) -> int:
    from ..metrics.plots import plot_run
    from ..rl.progress import RunProgress
    from ..rl.setup import build_run

    run_cfg, train_cfg, engine_cfg = configs_from_args(args)
    with RunProgress(run_cfg.num_rollout) as progress:
        rl = build_run(run_cfg, train_cfg, engine_cfg, progress=progress.update)
        progress.start(rl.rollout_id)
        rl.run()
    print(f"metrics: {rl.run_dir / 'metrics.jsonl'}")
    if run_cfg.plot:
        result = plot_run(rl.run_dir)
        print(f"plots: {rl.run_dir / 'plots'}  (reward slope per step: {result['reward_slope']:+.4f})")
    return 0
