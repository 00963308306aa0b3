"""Rollout-side memory per GPU: serving-format weights, caches for the concurrency, workspace.

An engine spans G = gpus_per_engine GPUs with expert parallelism G. Weight bytes per parameter
in the released formats (DSV4_SPEC.md): FP8 e4m3 1 B + one scale per 128x128 block (counted as
fp32, 4/16384 B), FP4 e2m1 0.5 B + one e8m0 scale per 32 (1/32 B), BF16 2 B, FP32 4 B.
`weight_format` (cluster.SERVED_AS): "native" serves each group as released (fp8 / fp4: lockstep's
"fp8-fp4"), "fp8" serves the fp4 groups in fp8 too, "bf16" every fp8 / fp4 group in bf16; bf16 and
fp32 groups stay as they are. `weight_formats` totals one copy of the model in each. Per GPU:
  routed experts        sum(expert groups) / G
  dense (attention "dp")   tp + replicated groups in full;   (attention "tp")  tp groups / G
  embedding and head    (attention "dp") in full;   (attention "tp")  / G (vocab-parallel)
                        (engine_expert_parallel.py, lockstep's EP engine, keeps the whole vocabulary
                        on every rank: it splits only the routed experts)

Cache per sequence of `seq_len` tokens, per layer (kvb = kv_cache_dtype bytes, d = head_dim):
  DeepSeek-V4  window  min(W, S) * d * kvb              (K = V: one tensor)
               C4      S/4 * d * kvb + S/4 * di * kvb (indexer keys)
                       + compressor tail 2*4 * (2d + 2di) * 2 * 4 B (kv + gate, fp32, overlapping)
               C128    S/128 * d * kvb + tail 128 * d * 2 * 4 B
  Llama        S * 2 * kv_heads * d * kvb
Sequences per GPU: ceil(concurrency / G) with "dp" attention; all `concurrency` with "tp"
attention, the cache split over min(G, kv_heads) (a single K=V head cannot be split).
Workspace: chunk_tokens * (one layer's activations per token) + sequences * V * 4 B logits.
Weight push staging: the whole push in the push format (bf16 / serving bytes per parameter, plus
tid2eid and router-bias buffers). lockstep/dist/weight_push.py receives every bucket into its own
buffer and stages the tensors as views of it until the two-phase commit's vote, so all buckets
are alive at once; an expert-parallel engine keeps only its experts' slices, but as views, so
their whole buckets stay too. The bucket being received is one of them: nothing extra.
The push runs with the engine paused (no prefill chunk in flight) and the caches kept, so the
GPU's peak is weights + caches + the larger of workspace and staging (memory.peak_gpu_bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lockstep.plan import activations as act
from lockstep.plan.cluster import DTYPE_BYTES, SERVED_AS, ClusterSpec, RolloutSpec
from lockstep.plan.layout import PlanError
from lockstep.plan.memory import MemoryTerm, peak_gpu_bytes
from lockstep.plan.model import ModelSpec
from lockstep.plan.params import ParamGroup, all_groups, buffer_bytes

SERVE_BYTES = {"fp8": 1 + 4 / 128**2, "fp4": 0.5 + 1 / 32, "bf16": 2.0, "fp32": 4.0}


@dataclass(frozen=True)
class RolloutMemory:
    terms: tuple[MemoryTerm, ...]
    engines: int
    seqs_per_gpu: int

    @property
    def gpu_bytes(self) -> float:
        """Peak bytes: weights and caches, plus the larger phase (generation's workspace, the push's staging)."""
        return peak_gpu_bytes(self.terms)

    def largest(self) -> MemoryTerm:
        return max(self.terms, key=lambda t: t.bytes)


def serve_bytes(g: ParamGroup, weight_format: str) -> float:
    """Bytes per parameter of a group in the serving format (cluster.SERVED_AS)."""
    return SERVE_BYTES[SERVED_AS[weight_format].get(g.serve, g.serve)]


@dataclass(frozen=True)
class FormatBytes:
    """One copy of the whole model's weights in one serving format, against bf16."""

    format: str  # a --rollout-weight-format value
    label: str  # lockstep's name of the serving format
    bytes: float
    ratio: float  # of the bf16 bytes


FORMAT_LABELS = {"bf16": "bf16", "fp8": "fp8", "native": "fp8-fp4 (native)"}  # the table's order


def weight_formats(model: ModelSpec) -> list[FormatBytes]:
    """Whole-model weight bytes (one copy, the tied head once, no buffers) in bf16, fp8 and native.

    A model released without fp8 / fp4 groups (the llama family) gets 1.0 everywhere: the planner
    serves it as released."""
    groups = all_groups(model)
    total = {f: sum(g.count * serve_bytes(g, f) for g in groups) for f in FORMAT_LABELS}
    return [FormatBytes(f, label, total[f], total[f] / total["bf16"]) for f, label in FORMAT_LABELS.items()]


def weight_bytes_per_gpu(model: ModelSpec, rollout: RolloutSpec) -> dict[str, float]:
    """{'experts', 'dense', 'vocab'} weight bytes on one GPU of an engine."""
    G, out = rollout.gpus_per_engine, {"experts": 0.0, "dense": 0.0, "vocab": 0.0}
    for g in all_groups(model):
        b = g.count * serve_bytes(g, rollout.weight_format)
        if g.shard == "expert":
            out["experts"] += b / G
        elif g.shard == "vocab":
            out["vocab"] += b / G if rollout.attention == "tp" else b
        elif g.shard == "tp" and rollout.attention == "tp":
            out["dense"] += b / G
        else:
            out["dense"] += b
    return out


def cache_bytes_per_seq(model: ModelSpec, seq_len: int, kv_dtype: str) -> float:
    """Cache of one sequence of `seq_len` tokens over all layers (formulas above)."""
    kvb, d, S = DTYPE_BYTES[kv_dtype], model.head_dim, seq_len
    if model.family != "deepseek_v4":
        return model.num_layers * S * 2 * model.num_kv_heads * d * kvb
    total = 0.0
    for i in range(model.num_layers):
        ratio = model.layer_kind(i)
        total += min(model.sliding_window, S) * d * kvb
        if ratio == 4:
            di = model.index_head_dim
            total += S // 4 * (d + di) * kvb + 2 * 4 * (2 * d + 2 * di) * 2 * 4
        elif ratio:
            total += S // ratio * d * kvb + ratio * d * 2 * 4
    return total


def _seqs_and_split(model: ModelSpec, rollout: RolloutSpec) -> tuple[int, int]:
    if rollout.attention == "dp":
        return math.ceil(rollout.concurrency / rollout.gpus_per_engine), 1
    return rollout.concurrency, max(1, min(rollout.gpus_per_engine, model.num_kv_heads))


def check_rollout(model: ModelSpec, cluster: ClusterSpec, rollout: RolloutSpec) -> None:
    G = rollout.gpus_per_engine
    if cluster.rollout_gpus % G:
        raise PlanError(f"--rollout-gpus-per-engine {G} does not divide the {cluster.rollout_gpus} rollout GPUs")
    if model.is_moe and model.n_routed_experts % G:
        raise PlanError(f"rollout EP {G} does not divide the {model.n_routed_experts} routed experts")
    if rollout.attention == "tp" and model.num_attention_heads % G:
        raise PlanError(f"rollout TP {G} does not divide the {model.num_attention_heads} attention heads")


def rollout_memory(model: ModelSpec, cluster: ClusterSpec, rollout: RolloutSpec, seq_len: int) -> RolloutMemory:
    """Every memory term of one rollout GPU."""
    check_rollout(model, cluster, rollout)
    G, fmt = rollout.gpus_per_engine, rollout.weight_format
    w = weight_bytes_per_gpu(model, rollout)
    seqs, split = _seqs_and_split(model, rollout)
    per_seq = cache_bytes_per_seq(model, seq_len, rollout.kv_cache_dtype)
    layer = max(act.layer_bytes_per_token(model, i, 1, seq_len) for i in range(model.num_layers))
    staged = push_bytes(model, rollout)
    logits = seqs * model.vocab_size * 4
    terms = (
        MemoryTerm("routed experts", w["experts"], f"experts / EP {G} ({fmt})"),
        MemoryTerm("dense weights", w["dense"], f"attention + shared + mHC + norms ({rollout.attention} attention)"),
        MemoryTerm("embedding + head", w["vocab"],
                   f"vocab-parallel / {G}" if rollout.attention == "tp" else "replicated (dp attention)"),
        MemoryTerm("caches", seqs * per_seq / split,
                   f"{seqs} seqs x {per_seq / 1e6:.2f} MB/seq ({seq_len} tok, {rollout.kv_cache_dtype})"
                   + (f" / {split}" if split > 1 else "")),
        MemoryTerm("workspace", rollout.chunk_tokens * layer + logits,
                   f"{rollout.chunk_tokens} tok x {layer / 1e3:.1f} KB + {seqs} x V x 4 B", phase="generate"),
        MemoryTerm("weight push staging", staged,
                   f"every pushed tensor ({rollout.push_format}) held until the commit; engine paused",
                   phase="push"),
    )
    return RolloutMemory(terms=terms, engines=cluster.rollout_gpus // G, seqs_per_gpu=seqs)


def push_bytes(model: ModelSpec, rollout: RolloutSpec) -> float:
    """Bytes of one whole weight push: every parameter in the push format plus the buffers."""
    return buffer_bytes(model) + sum(g.count * push_bytes_per_param(g, rollout) for g in all_groups(model))


def push_bytes_per_param(g: ParamGroup, rollout: RolloutSpec) -> float:
    """Bytes one parameter of `g` sends in a weight push (comm.weight_push_term sums them): bf16
    (fp32 groups stay fp32) or the serving format."""
    if rollout.push_format == "serving":
        return serve_bytes(g, rollout.weight_format)
    return 4.0 if g.serve == "fp32" else 2.0

