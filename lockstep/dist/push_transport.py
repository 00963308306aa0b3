"""How a weight push moves the trainer's bytes to the engines, chosen once per world.

    broadcast  each bucket broadcast on the weight group (NCCL between GPUs; over gloo every byte is
               staged through host memory and a socket: 665x a device copy on one H200)
    shared     every rank on one host: the source packs the buckets into memory the engines map
               (shared_buckets.py): a pack, then the engines read the buckets
    mapped     every rank on one host: the engines map the trainer's own tensors and read them in
               place (mapped_weights.py): nothing packed; the fewest bytes moved
    auto       mapped where the weight group is gloo and every rank is on this host, else broadcast

A rank keeps what its transport needs from push to push in a pool (`new_pool`): the shared
transport's buckets and mappings, the mapped transport's exports and mappings.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from lockstep.dist.mapped_weights import MappedWeights
from lockstep.dist.shared_buckets import BucketPool

TRANSPORTS = ("auto", "broadcast", "shared", "mapped")
ONE_HOST = ("shared", "mapped")


def one_host(ctx) -> bool:
    """Every rank of the world runs on this host (torchrun's LOCAL_WORLD_SIZE is the world's size)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == ctx.world_size


def resolve_transport(ctx, requested: str = "auto") -> str:
    """The transport for this world (module docstring). auto is a collective: every rank learns the
    one answer; NCCL's broadcast is kept where it runs."""
    if requested not in TRANSPORTS:
        raise ValueError(f"weight push transport must be one of {TRANSPORTS}, got {requested!r}")
    if requested in ONE_HOST and not one_host(ctx):
        raise ValueError(f"rank {ctx.rank}: the {requested} weight-push transport needs every rank on one host "
                         f"(LOCAL_WORLD_SIZE {os.environ.get('LOCAL_WORLD_SIZE')} != world size {ctx.world_size})")
    if requested != "auto":
        return requested
    # ranks outside the weight group have no say (True)
    mine = ctx.weight_group is None or (dist.get_backend(ctx.weight_group) == "gloo" and one_host(ctx))
    return "mapped" if ctx.all_true(mine, "weight push transport") else "broadcast"


def pool_type(transport: str) -> type[BucketPool] | type[MappedWeights]:
    """The kind of pool `transport` keeps (a broadcast keeps nothing: an unused BucketPool)."""
    return MappedWeights if transport == "mapped" else BucketPool


def new_pool(transport: str) -> BucketPool | MappedWeights:
    """What a rank keeps from push to push for `transport`."""
    return pool_type(transport)()
