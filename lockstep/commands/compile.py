"""`lockstep compile`: compile the rollout engine's graphs once and keep them with the model.

    lockstep compile MODEL                                  # cuda + bfloat16 when a GPU is visible
    lockstep compile MODEL --device cuda --dtype bfloat16 --max-num-seqs 64 --max-model-len 4096

Starts the engine once, as train / serve / generate would with the same engine flags, with its
compile cache in MODEL/compile-cache (engine/compile_cache.py; --compile-cache-dir elsewhere), then
prints the start time and the artifact written. Train, serve and generate load it by default
(MODEL/compile-cache is used whenever it exists) when their torch, GPU, model and engine settings
match the ones compiled here: the artifact's KEY.json lists them. On a CPU, or in float32, the
engine compiles nothing with inductor: the command then says "nothing to cache" and writes no file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SKIPPED = ("device", "dtype", "eos_token_ids")  # device and dtype are this command's own flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lockstep.cli_args import add_dataclass_arguments
    from lockstep.config import EngineConfig

    parser.add_argument("model", metavar="MODEL", help="checkpoint directory; the artifacts go to MODEL/compile-cache")
    parser.add_argument("--device", default=None,
                        help="torch device to compile for, e.g. cuda, cuda:1 (default: cuda when a GPU is visible, "
                             "else cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="compute dtype; the engine compiles its decoder layers in bfloat16 only (default: "
                             "bfloat16)")
    add_dataclass_arguments(parser, EngineConfig, skip=SKIPPED, group="rollout engine (as the later runs set it)",
                            default_text={"compile_cache_dir": "MODEL/compile-cache"})


def run(args) -> int:
    import torch

    from lockstep.cli_args import dataclass_from_args
    from lockstep.config import EngineConfig
    from lockstep.engine import Engine
    from lockstep.engine.compile_cache import CACHE_SUBDIR

    path = Path(args.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json there (not a checkpoint directory)")
    cache_dir = getattr(args, "compile_cache_dir", None)
    if cache_dir == "":
        raise ValueError("--compile-cache-dir: lockstep compile needs a directory to write to")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = dataclass_from_args(EngineConfig, args, device=device, dtype=args.dtype,
                                 compile_cache_dir=cache_dir or str(path / CACHE_SUBDIR))
    started = time.perf_counter()
    engine = Engine.from_pretrained(path, config)
    total = time.perf_counter() - started
    cache = engine.compile_cache
    print(f"lockstep compile: engine start {engine.start_seconds:.1f} s ({total:.1f} s with loading the model); "
          f"{engine.serving_path}")
    if engine.compile_phases:  # where the start's seconds went (engine/compile_clock.py)
        print(f"lockstep compile: {engine.compile_phases}")
    print(f"lockstep compile: {cache.describe()}")
    if cache.saved_bytes:
        print(f"lockstep compile: artifact {cache.path} ({cache.saved_bytes / 1e6:.1f} MB); its settings: "
              f"{cache.path.with_suffix('.json')}")
    elif cache.status == "hit":
        print(f"lockstep compile: {cache.path} already holds every graph of this start")
    else:
        print(f"lockstep compile: nothing to cache on {device} in {args.dtype}: the engine compiles its layers "
              "with inductor on CUDA in bfloat16 (with --cuda-graph and --compile-decode)")
    return 0
