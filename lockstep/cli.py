"""The `lockstep` console entry point.

Each subcommand lives in `lockstep/commands/<name>.py` and exposes two functions:
`add_arguments(parser)` and `run(args) -> int`. Modules are imported only when their
subcommand runs, so `lockstep --help` stays fast and a missing optional dependency of
one command never breaks the others.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> one-line help. Order is the order `lockstep --help` lists them.
SUBCOMMANDS: dict[str, str] = {
    "train": "run RL post-training (GRPO and relatives); with no arguments, the embedded CPU default",
    "sft": "supervised warm-start of a model on a prompt/answer set",
    "generate": "sample completions from a model with the rollout engine",
    "serve": "serve a model over HTTP (OpenAI-compatible + native endpoints)",
    "compile": "compile the rollout engine's graphs once into MODEL/compile-cache (fast engine starts)",
    "eval": "evaluate a model on held-out sets with pass@k",
    "align": "compare trainer and rollout log-probabilities token by token",
    "plan": "find the parallel layouts (TP/PP/EP/CP) that fit a model on a cluster",
    "convert": "convert checkpoints: GGUF -> HF directory, fp8/fp4 <-> bf16",
    "plot": "plot a run's metrics into RUN_DIR/plots/",
}


def _load(name: str):
    return importlib.import_module(f"lockstep.commands.{name}")


def build_parser(names: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep", description="lockstep: RL post-training for MoE language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if names is None or name in names:
            _load(name).add_arguments(p)
    return parser


def _check_device(device: str | None) -> None:
    """`--device` names a device this torch can use (a CPU-only torch otherwise fails deep inside with
    "AssertionError: Torch not compiled with CUDA enabled")."""
    if device is None or device == "cpu":
        return
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise ValueError(f"--device {device}: not a torch device ({e})") from None
    if kind != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA support (torch " + torch.__version__ + ")" if torch.version.cuda is None
               else "no CUDA device is visible")
        raise ValueError(f"--device {device}: {why}; use --device cpu or a CUDA build of torch on a GPU machine")
    index, count = torch.device(device).index, torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(f"--device {device}: only {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1})")


def _parse(argv: list[str]):
    parser = build_parser([a for a in argv if a in SUBCOMMANDS][:1])
    args = parser.parse_args(argv)
    args.argv = argv  # a command that starts more processes hands them its own arguments
    return parser, args


def _run(args) -> int:
    # on Ray the ranks' devices are the actors', checked where they run (the driver may have no GPU)
    if getattr(args, "ray_address", None) is None:
        _check_device(getattr(args, "device", None))
    return int(_load(args.command).run(args) or 0)


def run_argv(argv: list[str]) -> int:
    """`lockstep ARGV` with errors raised instead of printed: what a Ray actor runs as its rank
    (lockstep/dist/ray_launch.py), so the driver receives the rank's exception."""
    return _run(_parse(argv)[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, args = _parse(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return _run(args)
    except (ValueError, OSError) as e:  # bad input: configs, data rows, checkpoints name what is wrong
        if os.environ.get("LOCKSTEP_TRACEBACK"):
            raise
        print(f"lockstep {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
