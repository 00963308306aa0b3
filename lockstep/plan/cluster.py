"""The cluster, the training setup and the rollout setup the planner is asked about.

Units: memory in GB = 1e9 bytes, bandwidth in GB/s per GPU per direction, compute in
TFLOP/s per GPU actually achieved (not peak). Defaults are stated assumptions, not measurements:
- intra-node 400 GB/s: the order of an 8-GPU NVLink / Infinity Fabric node per direction;
- inter-node 50 GB/s: one 400 Gb/s NIC per GPU;
- host link 50 GB/s: PCIe 5 x16, used by optimizer offload;
- 400 TFLOP/s: about half the bf16 GEMM figure measured on one H200 (793 TFLOP/s, DESIGN.md);
- host memory 2000 GB per node: the 2 TB of an 8 x H200 DGX node, checked against what optimizer
  offload keeps on the host (None: not checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
GB = 1e9
HOST_MEMORY_GB = 2000.0  # per node: an 8 x H200 DGX node's 2 TB


def dtype_bytes(name: str, field: str) -> float:
    if name not in DTYPE_BYTES:
        raise ValueError(f"{field} must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
    return DTYPE_BYTES[name]


def _positive(obj, *names):
    for name in names:
        value = getattr(obj, name)
        if value is None or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Nodes of identical GPUs, split into actor (training) and rollout (serving) nodes, or, with
    `colocate`, every GPU both (slime's --colocate; lockstep's colocated runs: each rank trains its
    part and serves): actor_nodes = rollout_nodes = nodes, and a GPU holds its actor stage's state and
    its engine's weights and caches at once (planner.colocated_stage)."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    actor_nodes: int
    rollout_nodes: int
    intra_node_gbs: float = 400.0
    inter_node_gbs: float = 50.0
    host_link_gbs: float = 50.0
    host_memory_gb: float | None = HOST_MEMORY_GB  # per node; None = not checked
    gpu_tflops: float = 400.0
    reserve_fraction: float = 0.10
    colocate: bool = False

    def __post_init__(self):
        _positive(self, "nodes", "gpus_per_node", "gpu_memory_gb", "actor_nodes", "rollout_nodes")
        _positive(self, "intra_node_gbs", "inter_node_gbs", "host_link_gbs", "gpu_tflops")
        if self.colocate:
            if not self.actor_nodes == self.rollout_nodes == self.nodes:
                raise ValueError(f"ClusterSpec: colocated, actor_nodes ({self.actor_nodes}) and rollout_nodes "
                                 f"({self.rollout_nodes}) must both be the {self.nodes} nodes (every GPU trains and serves)")
        elif self.actor_nodes + self.rollout_nodes > self.nodes:
            raise ValueError(
                f"ClusterSpec: actor_nodes ({self.actor_nodes}) + rollout_nodes ({self.rollout_nodes}) "
                f"exceeds nodes ({self.nodes})"
            )
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"ClusterSpec.reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.host_memory_gb is not None and self.host_memory_gb <= 0:
            raise ValueError(f"ClusterSpec.host_memory_gb must be > 0, got {self.host_memory_gb}")

    @property
    def actor_gpus(self) -> int:
        return self.actor_nodes * self.gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        """GPU memory left after the reserve for CUDA/HIP context, NCCL buffers, fragmentation."""
        return self.gpu_memory_gb * GB * (1 - self.reserve_fraction)


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """Actor-side setup (Megatron-style names; a CLI flag maps to one field).

    `max_tokens_per_gpu` is the micro-batch size in tokens on one GPU (packed sequences); with
    context parallelism a micro-batch of one data-parallel rank holds max_tokens_per_gpu * CP
    tokens. A step trains `rollout_batch_size * n_samples_per_prompt` sequences of up to
    `seq_len` tokens (the planner assumes full-length sequences: an upper bound).
    """

    seq_len: int
    max_tokens_per_gpu: int
    param_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    optimizer_dtype: str = "fp32"
    recompute: bool = False
    optimizer_offload: bool = False
    distributed_optimizer: bool = True
    decoder_last_pipeline_num_layers: int | None = None
    rollout_batch_size: int = 32
    n_samples_per_prompt: int = 8
    use_kl_loss: bool = False  # a frozen reference model for the KL loss lives next to the actor

    def __post_init__(self):
        _positive(self, "seq_len", "max_tokens_per_gpu", "rollout_batch_size", "n_samples_per_prompt")
        dtype_bytes(self.param_dtype, "TrainSpec.param_dtype")
        dtype_bytes(self.grad_dtype, "TrainSpec.grad_dtype")
        dtype_bytes(self.optimizer_dtype, "TrainSpec.optimizer_dtype")
        last = self.decoder_last_pipeline_num_layers
        if last is not None and last < 1:
            raise ValueError(f"TrainSpec.decoder_last_pipeline_num_layers must be >= 1, got {last}")

    @property
    def step_tokens(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt * self.seq_len

    @property
    def optimizer_bytes_per_param(self) -> float:
        """Adam: fp32 master copy (only when params are not fp32 already) + m + v."""
        master = 0.0 if self.param_dtype == "fp32" else 4.0
        return master + 2 * DTYPE_BYTES[self.optimizer_dtype]

    def micro_batches(self, dp: int, cp: int) -> int:
        """Micro-batches per data-parallel rank: ceil(step_tokens / (DP * max_tokens_per_gpu * CP))."""
        return max(1, math.ceil(self.step_tokens / (dp * self.max_tokens_per_gpu * cp)))


ATTENTION_MODES = ("dp", "tp")
# --rollout-weight-format: what each serves a group released in fp8 / fp4 as (others stay as released).
# "native" is lockstep's "fp8-fp4" serving format (fp8 attention and shared experts, fp4 routed
# experts); "fp8" its "fp8" format (e4m3 with 128x128 block scales everywhere). rollout.serve_bytes.
SERVED_AS = {"native": {}, "fp8": {"fp4": "fp8"}, "bf16": {"fp8": "bf16", "fp4": "bf16"}}
WEIGHT_FORMATS = tuple(SERVED_AS)
PUSH_FORMATS = ("bf16", "serving")


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """Serving-side setup: one engine spans `gpus_per_engine` GPUs with expert parallelism over
    all of them; attention is data-parallel ("dp": weights replicated, each GPU holds the cache of
    its own share of sequences) or tensor-parallel ("tp": heads split; a single shared K=V head
    cannot be split, so every GPU holds the cache of every sequence of the engine)."""

    concurrency: int = 256  # sequences in flight per engine
    gpus_per_engine: int = 8
    attention: str = "dp"
    weight_format: str = "native"
    kv_cache_dtype: str = "bf16"
    chunk_tokens: int = 8192  # chunked-prefill size: the activation workspace
    push_format: str = "bf16"

    def __post_init__(self):
        _positive(self, "concurrency", "gpus_per_engine", "chunk_tokens")
        dtype_bytes(self.kv_cache_dtype, "RolloutSpec.kv_cache_dtype")
        for name, allowed in (("attention", ATTENTION_MODES), ("weight_format", WEIGHT_FORMATS),
                              ("push_format", PUSH_FORMATS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"RolloutSpec.{name} must be one of {allowed}, got {getattr(self, name)!r}")
