"""Compute time of one training step on the busiest GPU (the pipeline stage with most work).

FLOPs per token of layer i (forward) = 2 * active matmul params(i) + attention(i), where
attention counts QK^T and PV (4 * h * d per attended entry) over the mean number of entries a
causal position p in [1, S] attends to:
  DeepSeek-V4  window min(W, p) + C4: min(topk, p/4) + C128: p/128, and the C4 indexer scores
               2 * hi * di * p/4;
  Llama        p.
Per GPU: micro-batches * t / TP tokens (the CP ranks each hold t of a DP rank's t * CP tokens,
TP splits the work), times (1 forward + 2 backward + 1 recompute forward if enabled), plus the
LM head (2 * V * H per token, last stage). Time = FLOPs / achieved TFLOP/s, stretched by the 1F1B
pipeline bubble (1 + (PP - 1) / micro-batches).
"""

from __future__ import annotations

from lockstep.plan.cluster import ClusterSpec, TrainSpec
from lockstep.plan.layout import Layout
from lockstep.plan.model import ModelSpec
from lockstep.plan.params import layer_groups, matmul_params_per_token


def mean_min(cap: float, slope: float, seq_len: int) -> float:
    """Mean over p = 1..S of min(cap, slope * p), continuous approximation."""
    S = float(seq_len)
    knee = cap / slope if slope > 0 else float("inf")
    if knee >= S:
        return slope * (S + 1) / 2
    return (slope * knee * knee / 2 + cap * (S - knee)) / S


def attention_flops_per_token(m: ModelSpec, i: int, seq_len: int) -> float:
    """Forward attention-score FLOPs of one token in layer i (module docstring)."""
    per_entry = 4 * m.num_attention_heads * m.head_dim
    if m.family != "deepseek_v4":
        return per_entry * (seq_len + 1) / 2
    ratio = m.layer_kind(i)
    entries = mean_min(m.sliding_window, 1.0, seq_len)
    index = 0.0
    if ratio == 4:
        entries += mean_min(m.index_topk, 0.25, seq_len)
        index = 2 * m.index_n_heads * m.index_head_dim * mean_min(float("inf"), 0.25, seq_len)
    elif ratio:
        entries += mean_min(float("inf"), 1 / ratio, seq_len)
    return per_entry * entries + index


def layer_flops_per_token(m: ModelSpec, i: int, seq_len: int) -> float:
    return 2 * matmul_params_per_token(layer_groups(m, i), m) + attention_flops_per_token(m, i, seq_len)


def forward_flops_per_token(m: ModelSpec, layers: range, seq_len: int, last: bool) -> float:
    """Forward FLOPs of one token through `layers`, plus the LM head when `last`."""
    per_token = sum(layer_flops_per_token(m, i, seq_len) for i in layers)
    return per_token + (2 * m.vocab_size * m.hidden_size if last else 0)


def train_passes(recompute: bool) -> int:
    """Forward-equivalents of a training step: 1 forward + 2 backward (+ 1 recompute forward)."""
    return 4 if recompute else 3


def train_flops_per_token(m: ModelSpec, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs of one token of a seq_len sequence through the whole model. Model FLOPs
    (the MFU numerator) leave recompute out: benchmarks/train_throughput.py divides by this."""
    return forward_flops_per_token(m, range(m.num_layers), seq_len, True) * train_passes(recompute)


def stage_flops(m: ModelSpec, train: TrainSpec, layout: Layout, layers: range, last: bool) -> float:
    """Training FLOPs of one GPU of a stage for one step."""
    tokens = train.micro_batches(layout.dp, layout.cp) * train.max_tokens_per_gpu / layout.tp
    return tokens * forward_flops_per_token(m, layers, train.seq_len, last) * train_passes(train.recompute)


def compute_seconds(m: ModelSpec, cluster: ClusterSpec, train: TrainSpec, layout: Layout,
                    stages: list[range]) -> tuple[float, float]:
    """(busiest stage's compute seconds, pipeline bubble fraction)."""
    flops = max(stage_flops(m, train, layout, r, s == len(stages) - 1) for s, r in enumerate(stages))
    bubble = (layout.pp - 1) / train.micro_batches(layout.dp, layout.cp)
    return flops / (cluster.gpu_tflops * 1e12), bubble
