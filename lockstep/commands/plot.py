"""`lockstep plot RUN_DIR [--compare OTHER_DIR ...]`: draw a run's metrics.jsonl into RUN_DIR/plots/*.png.

Prints the files written and the least-squares slope of rollout/raw_reward per step. Exit status
0 on success, 1 if a metrics.jsonl is missing or malformed (the error names file and line).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    parser.add_argument("--window", type=int, default=10, help="moving-average window for the reward plot (steps)")
    parser.add_argument("--compare", nargs="+", default=[], metavar="OTHER_DIR",
                        help="other run directories drawn into the mismatch and reward figures, labelled by name "
                             "(e.g. the same run without --true-on-policy)")


def run(args: argparse.Namespace) -> int:
    from lockstep.metrics.plots import REWARD_KEY, plot_run
    from lockstep.metrics.sinks import MetricsFileError

    try:
        result = plot_run(args.run_dir, window=args.window, compare=args.compare)
    except MetricsFileError as e:
        print(f"lockstep plot: error: {e}", file=sys.stderr)
        return 1
    for path in result["files"]:
        print(f"wrote {path}")
    if result["reward_slope"] is not None:
        print(f"{REWARD_KEY} slope: {result['reward_slope']:.6g} per step")
    else:
        print(f"{REWARD_KEY}: not in metrics.jsonl, no trend to report")
    return 0
