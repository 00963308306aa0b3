"""Started by torch's launcher (test_launch.py): a colocated world, every rank a trainer and an engine.

Rank 0 is the push source and stages its own buckets; rank 1's trainer only walks its weights in
step. Each rank writes what it saw to OUT_DIR/rank<r>.json.
"""

import json
import os
import sys

import torch

from lockstep.dist.groups import init_distributed
from lockstep.dist.manifest import build_manifest
from lockstep.dist.weight_push import push_weights
from test_weight_push import BUCKET, engine, new_policy, poison

if __name__ == "__main__":
    torch.set_num_threads(1)
    ctx = init_distributed(30.0)
    trainer, pushed, reference = new_policy(), engine("fp8"), engine("fp8")
    reference.update_weights(trainer.named_weights(), version=1)
    poison(pushed)
    metrics = push_weights(ctx, build_manifest(trainer.model, torch.float32, BUCKET), 1,
                           named_tensors=trainer.named_weights(), engine=pushed)
    ref = reference.model.state_dict()
    differs = [n for n, t in pushed.model.state_dict().items() if not torch.equal(t, ref[n])]
    seen = dict(rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank, colocated=ctx.layout.is_colocated,
                differs=differs, version=pushed.weight_version, bytes=metrics["perf/weight_sync_bytes"],
                env_rank=os.environ["RANK"])
    with open(os.path.join(sys.argv[1], f"rank{ctx.rank}.json"), "w") as f:
        json.dump(seen, f)
