"""The plan's memory per pipeline stage and phase against a run's measured peaks (issue 19).

    lockstep plan --colocate --nodes 1 --gpus-per-node 8 ... --pp 4 --ep 2 --json > plan.json
    lockstep train --model DIR --layout plan.json --run-dir runs/pp4ep2 ...
    python benchmarks/plan_vs_measured.py --plan plan.json --run runs/pp4ep2

prints, per stage and phase (rollout, train, weight_sync), the plan's GB, the largest peak any of
the stage's ranks measured over the run's steps, and the plan's error in % (lockstep/plan/measured.py
says how they pair up). The layout compared is the one `lockstep train --layout` ran (the plan's
best-ranked runnable layout that fits) unless --entry N names another (1-based, as the plan ranks).
On a GPU the measurement is torch.cuda.max_memory_allocated; on a CPU the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lockstep.files import read_json
from lockstep.plan.measured import compare, report
from lockstep.plan.train_flags import chosen_layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="a `lockstep plan --json` file")
    ap.add_argument("--run", required=True, help="the run directory (its metrics.jsonl)")
    ap.add_argument("--entry", type=int, default=None, help="the plan's layout N (1-based; default: the one run)")
    args = ap.parse_args(argv)
    if args.entry is None:
        index, entry, _ = chosen_layout(args.plan)
    else:
        index, entry = args.entry, read_json(args.plan)[args.entry - 1]
    metrics = Path(args.run) / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    label = " ".join(f"{d.upper()}{entry[d]}" for d in ("tp", "pp", "ep", "cp"))
    print(f"plan {args.plan} #{index} ({label}{', colocated' if entry.get('colocate') else ''}) against {metrics}:")
    for line in report(compare(entry, lines)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
