"""`EngineReplicas`: the Engine seam over the world's data-parallel engine replicas (one per engine rank).

    engines = EngineReplicas(ctx, Engine.from_pretrained(path, config))
    samples = engines.generate(requests)     # on every rank, with the same requests

Every rank of the world calls `generate` with the same request list (the loop builds it from the
same prompt source, seeds and rollout id everywhere). The requests -- one prompt group each -- are
cut into contiguous blocks, one per engine rank in rank order (`shard`); each replica generates its
block, and the samples are gathered to every rank in rank order, which is the order one engine
returns them in (request order, the n samples of a request consecutive). A request's seed comes
from (run seed, rollout id, round, prompt slot) (rl/rollout.py) and the engine is batch-invariant
on the policy path, so a sample does not depend on which replica drew it, nor on what else that
replica ran (tests/dist/test_replicas.py: token ids and logprobs equal one engine's).

The gather is `all_gather_object` on the gloo control group: the samples are pickled, tensors
included. That is fine for the CPU proof and small rollouts; a large GPU rollout should gather the
flat token / logprob tensors instead (not built yet).

Weights: colocated, each rank's engine takes its own trainer's full weights in-process
(`update_weights`, as the one-process loop does); every rank calls it at the same point because
`Trainer.named_weights()` gathers FSDP shards (a collective).
"""

from __future__ import annotations

import torch.distributed as dist

from lockstep.dist.groups import DistContext


def shard(num_items: int, num_shards: int, index: int) -> slice:
    """Shard `index` of `num_items` cut into `num_shards` contiguous blocks whose sizes differ by at
    most one (larger first), e.g. 5 items, 2 shards -> [0:3], [3:5]; a block may be empty."""
    base, extra = divmod(num_items, num_shards)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


class EngineReplicas:
    """generate / update_weights / weight_version over the engine ranks (module docstring)."""

    def __init__(self, ctx: DistContext, engine):
        if not ctx.is_engine:
            raise ValueError(f"rank {ctx.rank}: EngineReplicas needs an engine rank (a colocated layout); the "
                             f"disaggregated loop is not built yet")
        self.ctx, self.engine = ctx, engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def my_requests(self, requests: list) -> list:
        ranks = self.ctx.layout.engine_ranks
        return requests[shard(len(requests), len(ranks), ranks.index(self.ctx.rank))]

    def generate(self, requests: list) -> list:
        """Every rank's samples for `requests`, in the order one engine returns them."""
        local = self.engine.generate(self.my_requests(requests))
        parts: list = [None] * self.ctx.world_size
        with self.ctx.collective(f"all_gather_object of rollout samples ({len(requests)} requests)"):
            dist.all_gather_object(parts, local, group=self.ctx.control_group)
        return [s for r in self.ctx.layout.engine_ranks for s in parts[r]]

    def update_weights(self, named_tensors, version: int) -> None:
        self.engine.update_weights(named_tensors, version=version)
