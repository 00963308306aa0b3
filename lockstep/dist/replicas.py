"""`EngineReplicas`: the Engine seam over the world's data-parallel engine replicas (one per engine rank).

    engines = EngineReplicas(ctx, Engine.from_pretrained(path, config))
    samples = engines.generate(requests)     # on every rank, with the same requests

Every rank of the world calls `generate` with the same request list (the loop builds it from the
same prompt source, seeds and rollout id everywhere). The requests -- one prompt group each -- are
cut into contiguous blocks, one per engine rank in rank order (`shard`); each replica generates its
block, and the samples are gathered to every rank in rank order, which is the order one engine
returns them in (request order, the n samples of a request consecutive). A request's seed comes
from (run seed, rollout id, round, prompt slot) (rl/rollout.py), so with `EngineConfig.batch_invariant`
(`--batch-invariant`) a sample depends neither on which replica drew it nor on what else that
replica ran (tests/dist/test_replicas.py: tokens and logprobs bitwise one engine's on all prompts).
Without it, on the CPU, logprobs move by ~1e-7 with the batch (the tokens stayed the same in the
tests, though such a shift could flip one).

The gather is on the gloo control group (lockstep/dist/sample_gather.py): each rank's token ids,
logprobs, loss masks and routed experts as one flat tensor per field, only the small fields (reward,
group id, finish reason, metadata, the tensors' shapes) pickled. A rank whose block is done (a
trainer-only rank: the whole rollout) waits in its first step, so the world's timeout must exceed
the longest rollout.

Weights, `update_weights(named_tensors, version)` on every rank at the same point:
    colocated       each rank's engine takes its own trainer's full weights in-process (as the
                    one-process loop does; `Trainer.named_weights()` gathers FSDP shards, a
                    collective, so every rank calls it together)
    disaggregated   `push_weights` (lockstep/dist/weight_push.py): trainer ranks pass their
                    named_weights, engine ranks their engine; buckets broadcast from the first
                    trainer rank, two-phase commit. A trainer-only rank holds no engine: it
                    contributes no samples, keeps the version number and needs the tokenizer.
                    Where every rank is on one host and the weight group is gloo, the engines
                    map the trainer's own tensors (push_transport.py: "mapped"); each rank keeps
                    its pool for the run, so no push exports or maps them again.
"""

from __future__ import annotations

from lockstep.dist.groups import DistContext
from lockstep.dist.push_transport import new_pool, resolve_transport
from lockstep.dist.sample_gather import gather_samples
from lockstep.dist.weight_push import push_weights


def shard(num_items: int, num_shards: int, index: int) -> slice:
    """Shard `index` of `num_items` cut into `num_shards` contiguous blocks whose sizes differ by at
    most one (larger first), e.g. 5 items, 2 shards -> [0:3], [3:5]; a block may be empty."""
    base, extra = divmod(num_items, num_shards)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


class EngineReplicas:
    """generate / update_weights / weight_version over the engine ranks (module docstring).

    `engine`: this rank's Engine, None on a trainer-only rank (then `tokenizer` is needed);
    `manifest`: the weight push's manifest, needed in the disaggregated layout."""

    def __init__(self, ctx: DistContext, engine=None, *, tokenizer=None, manifest=None):
        if ctx.is_engine != (engine is not None):
            raise ValueError(f"rank {ctx.rank}: an engine rank needs its engine, another rank must not have one")
        if not ctx.layout.is_colocated and manifest is None:
            raise ValueError(f"rank {ctx.rank}: the disaggregated layout pushes weights and needs their manifest")
        self.ctx, self.engine, self.manifest = ctx, engine, manifest
        self._tokenizer = tokenizer if engine is None else engine.tokenizer
        self._version = 0  # a trainer-only rank's record of what the engines serve
        self._transport: str | None = None  # the push's, agreed at the first push (a collective)
        self._pool = None  # what the transport keeps from push to push (push_transport.new_pool)

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version if self.engine is not None else self._version

    def my_requests(self, requests: list) -> list:
        ranks = self.ctx.layout.engine_ranks
        if not self.ctx.is_engine:
            return []
        return requests[shard(len(requests), len(ranks), ranks.index(self.ctx.rank))]

    def generate(self, requests: list) -> list:
        """Every rank's samples for `requests`, in the order one engine returns them."""
        mine = self.my_requests(requests)
        # an engine rank calls generate even with no requests: an expert-parallel engine's rank must
        # take part in its peers' steps (engine_expert_parallel.py); a plain Engine returns at once
        local = self.engine.generate(mine) if self.engine is not None else []
        parts = gather_samples(local, self.ctx.control_group, self.ctx.collective,
                               f"rollout samples ({len(requests)} requests)")
        return [s for r in self.ctx.layout.engine_ranks for s in parts[r]]

    def update_weights(self, named_tensors, version: int) -> dict[str, float]:
        """The new weights into every engine (module docstring); push metrics when pushed."""
        if self.ctx.layout.is_colocated:
            self.engine.update_weights(named_tensors, version=version)
            return {}
        if self._transport is None:  # every rank is here at the same point of the loop
            self._transport = resolve_transport(self.ctx)
            self._pool = new_pool(self._transport)
        metrics = push_weights(self.ctx, self.manifest, version, named_tensors=named_tensors, engine=self.engine,
                               transport=self._transport, pool=self._pool)
        self._version = version
        return metrics
