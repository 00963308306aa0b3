"""`lockstep train`: RL post-training. With no arguments: GRPO on the embedded tiny
DeepSeek-V4 and synthetic arithmetic, TIS on, on the CPU, plots written at the end.

On N processes: `lockstep train --nproc-per-node N ...` starts the world through torch's launcher
(lockstep/dist/launch.py), which runs `python -m lockstep.cli train ...` (the launch flags removed)
in each process; a process started by a launcher (`torchrun -m lockstep.cli train ...` too) joins
the world (lockstep/dist/groups.py) and runs its rank's part (lockstep/rl/data_parallel.py).
`--ray-address` places the same ranks as Ray actors instead (lockstep/dist/ray_launch.py), each running
that same part. With one process and no launcher, today's single-process path runs, untouched."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

from ..cli_args import add_dataclass_arguments, dataclass_from_args
from ..config import EngineConfig
from ..dist.config import DistConfig
from ..rl.config import RunConfig
from ..rl.embedded import ENGINE_RECIPE, RUN_RECIPE, TRAIN_RECIPE
from .presets import PROMPT_ROOM, default_text, describe, engine_preset, preset

# set from RunConfig instead (one flag per concept)
TRAIN_SHARED = ("temperature", "seed", "rollout_max_response_len")
# compile_hc: both sides compile mHC alike; true_on_policy: both sides run that forward
ENGINE_SHARED = ("dtype", "eos_token_ids", "compile_hc", "true_on_policy")
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
    add_dataclass_arguments(parser, DistConfig, group="processes and nodes")


def configs_from_args(args):
    from ..engine.compile_cache import default_dir
    from ..train.config import TrainConfig

    run = dataclass_from_args(RunConfig, args, **preset(args, RUN_RECIPE))
    train = dataclass_from_args(TrainConfig, args, temperature=run.rollout_temperature, seed=run.seed,
                                rollout_max_response_len=run.rollout_max_response_len,
                                **preset(args, TRAIN_RECIPE))
    engine = dataclass_from_args(EngineConfig, args, dtype=train.dtype, compile_hc=train.compile_hc,
                                 true_on_policy=train.true_on_policy, **engine_preset(
        args, run.rollout_max_response_len, run.eval_max_response_len),
        compile_cache_dir=default_dir(run.model, getattr(args, "compile_cache_dir", None)))
    return (run, *agree_true_on_policy(train, engine, dataclass_from_args(DistConfig, args)))


def agree_true_on_policy(train, engine: EngineConfig, dist: DistConfig):
    """(train, engine) with true_on_policy off on both where it was left to the default (None) and
    either side rules it out (expert parallel, packed weights): each side deciding alone would run
    the true-on-policy forward on one side only, paying for it without the equal logprobs."""
    if train.true_on_policy is not None or not any(c.true_on_policy_excluded_by() for c in (train, engine, dist)):
        return train, engine
    return dataclasses.replace(train, true_on_policy=False), dataclasses.replace(engine, true_on_policy=False)


class _LayoutFlagParser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag in a --layout file: raised, for apply_layout to name the file
        raise ValueError(message)


def apply_layout(args) -> str | None:
    """--layout FILE: the `lockstep train` flags of the file's chosen layout (lockstep/plan/train_flags.py
    `chosen_layout`) set on `args`, parsed by this command's own parser. A flag given on the command line
    that the layout sets too must have the layout's value, else an error naming both: the plan's memory
    and time estimates hold for the layout's values, so a silent override would run an unplanned layout.
    Returns the line saying which layout was taken (None without --layout)."""
    from ..files import FileError
    from ..plan.train_flags import chosen_layout, layout_label

    path = getattr(args, "layout", "")
    if not path:
        return None
    index, entry, passed = chosen_layout(path)
    parser = _LayoutFlagParser(prog="lockstep train")
    add_arguments(parser)
    try:
        planned, unknown = parser.parse_known_args(entry["train_flags"])
    except ValueError as e:
        raise FileError(f"{path}: layout #{index}: field 'train_flags': {e}") from None
    if unknown:
        raise FileError(f"{path}: layout #{index}: field 'train_flags': lockstep train has no {' '.join(unknown)}")
    for name, value in vars(planned).items():
        flag = "--" + name.replace("_", "-")
        if hasattr(args, name) and getattr(args, name) != value:
            raise ValueError(f"{flag} {getattr(args, name)} conflicts with --layout {path}, whose layout #{index} "
                             f"sets {flag} {value}: drop the flag, or plan with the value you want")
        setattr(args, name, value)
    over = f" (passed over: {'; '.join(passed)})" if passed else ""
    return f"--layout {path}: layout #{index} ({layout_label(entry)}): {' '.join(entry['train_flags'])}{over}"


def run(args) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..dist.groups import launched
    from ..dist.launch import launch, should_launch, strip_launch_flags

    note = apply_layout(args)
    if note and not launched():  # once, from the command the user ran
        print(note)
    dist_cfg = dataclass_from_args(DistConfig, args)
    configs = configs_from_args(args)  # bad flags fail here, before any process starts
    if should_launch(dist_cfg) or not launched():  # a plain torchrun's world is checked once it is known
        from ..rl.data_parallel import check_pipeline

        ranks = (dist_cfg.actor_num_gpus or dist_cfg.world_size) if should_launch(dist_cfg) else 1
        check_pipeline(configs[1], configs[0], ranks, dist_cfg.colocated)
    if should_launch(dist_cfg):
        argv = getattr(args, "argv", None) or sys.argv[1:]
        if dist_cfg.ray_address is not None:
            return _on_ray(dist_cfg, configs[2].device, strip_launch_flags(argv))
        try:
            launch(dist_cfg, ["-m", "lockstep.cli", *strip_launch_flags(argv)])
        except ChildFailedError as e:  # torch's summary: the first failed rank, its exit code and error
            print(f"lockstep train: error: {e}", file=sys.stderr)
            return 1
        return 0
    if not launched():
        return _train(args, *configs)
    return _rank(args, configs, dist_cfg)


def _on_ray(dist_cfg: DistConfig, device: str, argv: list[str]) -> int:
    """Each rank in an actor on the Ray cluster (lockstep/dist/ray_launch.py), running what a torchrun
    process runs: `lockstep train ARGV` in a launched process, i.e. `_rank`."""
    import torch

    from ..cli import run_argv
    from ..dist.ray_launch import RayLaunchError, launch_on_ray

    try:
        launch_on_ray(dist_cfg, torch.device(device).type, run_argv, argv)
    except RayLaunchError as e:
        print(f"lockstep train: error: {e}", file=sys.stderr)
        return 1
    return 0


def _record(fn):
    # in a launched process, torch's @record writes an uncaught error where the launcher reads it, so
    # the launcher's summary carries the message (e.g. a DistributedError naming rank and operation)
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


@_record
def _rank(args, configs, dist_cfg: DistConfig) -> int:
    """This process's part of a launched world: join it, run, leave."""
    from ..dist.groups import destroy_distributed, init_distributed

    ctx = init_distributed(dist_cfg.distributed_timeout, config=dist_cfg)
    try:
        return _train(args, *configs, dist_ctx=ctx, weight_buffer_size=dist_cfg.update_weight_buffer_size,
                      rollout_ep_size=dist_cfg.rollout_expert_parallel_size)
    finally:
        destroy_distributed()


def _train(args, run_cfg, train_cfg, engine_cfg, dist_ctx=None,
           weight_buffer_size: int = DistConfig.update_weight_buffer_size, rollout_ep_size: int = 1) -> int:
    from ..metrics.plots import plot_run
    from ..rl.progress import RunProgress
    from ..rl.setup import build_run

    primary = dist_ctx is None or dist_ctx.rank == 0
    if primary:
        print(describe(args))
    with RunProgress(run_cfg.num_rollout) if primary else contextlib.nullcontext() as progress:
        rl = build_run(run_cfg, train_cfg, engine_cfg, progress=progress and progress.update, dist_ctx=dist_ctx,
                       weight_buffer_size=weight_buffer_size, rollout_ep_size=rollout_ep_size)
        if progress:
            progress.start(rl.rollout_id)
        rl.run()
    if not primary:
        return 0
    print(f"metrics: {rl.run_dir / 'metrics.jsonl'}")
    if run_cfg.plot:
        result = plot_run(rl.run_dir)
        print(f"plots: {rl.run_dir / 'plots'}  (reward slope per step: {result['reward_slope']:+.4f})")
    return 0
