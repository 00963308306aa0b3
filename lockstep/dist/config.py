"""`DistConfig`: how one lockstep job spreads over processes (launch, layout, timeouts, weight push).

Flag names follow the Miles launcher (`--actor-num-gpus`, `--rollout-num-gpus`,
`--update-weight-buffer-size`) and torchrun (`--nproc-per-node`, `--nnodes`, `--node-rank`,
`--master-addr`, `--master-port`). Layout: with neither actor_num_gpus nor rollout_num_gpus set,
every process both trains and serves (colocated); with both set, ranks [0, actor_num_gpus) train
and the next rollout_num_gpus ranks serve (disaggregated); their sum must be the world size, which
`lockstep.dist.groups.Layout` checks once the world is known. With ray_address the same world is
placed on a Ray cluster (lockstep/dist/ray_launch.py) instead of started by torchrun.
"""

from __future__ import annotations

from dataclasses import dataclass


def _fail(field_name: str, why: str):
    raise ValueError(f"DistConfig.{field_name}: {why}")


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """Distributed settings; each field's documentation is the string below it (also its --help)."""

    nproc_per_node: int = 1
    """Processes started on this node by torch's launcher (torch.distributed.run); 1: no launcher."""
    nnodes: int = 1
    """Nodes of the job (torchrun --nnodes)."""
    node_rank: int = 0
    """This node's index among the job's nodes (torchrun --node-rank)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the rendezvous store runs (torchrun --master-addr)."""
    master_port: int = 29500
    """TCP port of the rendezvous store on node 0 (torchrun --master-port)."""
    actor_num_gpus: int | None = None
    """Disaggregated layout: ranks [0, actor_num_gpus) train; None (with rollout_num_gpus None): colocated,
    every rank trains and serves."""
    rollout_num_gpus: int | None = None
    """Disaggregated layout: the rollout_num_gpus ranks after the trainer ranks serve."""
    distributed_timeout: float = 600.0
    """Seconds any collective (and the rendezvous) may wait for a peer before the run fails with the rank and
    the operation named."""
    update_weight_buffer_size: int = 512 * 1024 ** 2
    """Bytes per weight-push bucket (one flat broadcast each); a tensor larger than this gets a bucket of its
    own."""
    rollout_expert_parallel_size: int = 1
    """Colocated runs: shard the engines' routed experts over this many engine ranks (all of them for now),
    each rank keeping its own attention, caches and requests (SGLang's --ep-size with --enable-dp-attention;
    lockstep/dist/engine_expert_parallel.py); 1: every engine holds every expert."""
    ray_address: str | None = None
    """Start the world on this Ray cluster instead of torchrun (`auto` or HOST:PORT of its head; needs
    `pip install 'lockstep-rl[ray]'`): one actor per rank in a PACK placement group, nproc_per_node x nnodes
    ranks; rank 0's actor picks the master address and port."""

    def __post_init__(self):
        for f in ("nproc_per_node", "nnodes", "update_weight_buffer_size", "rollout_expert_parallel_size"):
            if getattr(self, f) < 1:
                _fail(f, f"must be >= 1, got {getattr(self, f)}")
        if not 0 <= self.node_rank < self.nnodes:
            _fail("node_rank", f"must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if not 0 < self.master_port < 65536:
            _fail("master_port", f"must be a TCP port, got {self.master_port}")
        if not self.distributed_timeout > 0:
            _fail("distributed_timeout", f"must be > 0 seconds, got {self.distributed_timeout}")
        if (self.actor_num_gpus is None) != (self.rollout_num_gpus is None):
            _fail("actor_num_gpus", "set both actor_num_gpus and rollout_num_gpus (disaggregated) or neither "
                  "(colocated)")
        if self.ray_address is not None and not self.ray_address.strip():
            _fail("ray_address", "must be `auto` or HOST:PORT of a Ray head, got an empty string")
        if self.ray_address is not None and self.node_rank != 0:
            _fail("node_rank", f"must be 0 with ray_address: one driver places every rank, got {self.node_rank}")
        for f in ("actor_num_gpus", "rollout_num_gpus"):
            if getattr(self, f) is not None and getattr(self, f) < 1:
                _fail(f, f"must be >= 1, got {getattr(self, f)}")
        self._check_engine_ep()

    def _check_engine_ep(self) -> None:
        """The layout part; EP = the engine ranks is checked once the world is known (engine_expert_parallel.py)."""
        ep = self.rollout_expert_parallel_size
        if ep > 1 and not self.colocated:
            _fail("rollout_expert_parallel_size", f"{ep}: the expert-parallel engine runs colocated only (every rank "
                  "trains and serves); with actor_num_gpus / rollout_num_gpus it is not built")

    def true_on_policy_excluded_by(self) -> str | None:
        """The field that rules the true-on-policy forward out of the run (EngineConfig's and TrainConfig's
        methods of this name say theirs): the expert-parallel engine holds a shard of the experts."""
        return "rollout_expert_parallel_size" if self.rollout_expert_parallel_size > 1 else None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def colocated(self) -> bool:
        return self.actor_num_gpus is None
