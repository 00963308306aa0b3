"""Communication of one training step, bytes sent by one GPU and estimated seconds.

t = max_tokens_per_gpu, mb = micro-batches per DP rank, L = layers of the largest stage,
passes = 2 (forward, backward) or 3 with recompute (the forward runs again), a = 2 B (bf16).
Ring collectives over g ranks: all-reduce sends 2(g-1)/g of the buffer, all-gather and
reduce-scatter (g-1)/g. A group spanning nodes runs at the inter-node bandwidth; an all-to-all
splits its bytes by destination and takes max(intra / intra_bw, inter / inter_bw).

  TP  (sequence parallel: all-gather + reduce-scatter = one all-reduce of t*H*a, for attention and
      for the shared expert / dense MLP)   mb * L * blocks * passes * 2(TP-1)/TP * t*H*a
  EP  (dispatch + combine)                  mb * L * passes * 2 * (t/TP)*k*H*a * (EP-1)/EP
  PP  (activations forward, gradients back; V4 sends its n mHC streams)   mb * 2 * t*n*H*a / TP
  CP  (all-gather of K/V and its gradient)  mb * L * passes * (CP-1) * t * kv_bytes_per_token
  DP  distributed optimizer: reduce-scatter grads + all-gather params over DP*CP (dense) and EDP
      (experts): (g-1)/g * P * (grad_bytes + param_bytes); otherwise all-reduce 2(g-1)/g * P * grad_bytes
  offload  gradient shard to host (4 B) and updated bf16 shard back, over the host link
  weight push  each pipeline stage's first rank gathers its stage (TP peers, then EP peers) and
      broadcasts it to the rollout engines over its NIC; stages send in parallel, so the push
      takes the slowest stage: gather + stage_bytes / inter_bw. Colocated (ClusterSpec.colocate),
      every GPU's engine takes the whole model from the trainers beside it: a GPU receives every
      other stage (the stages broadcast in turn over the PP ring) and its EP peers' experts of its
      own stage: (total - own stage) / PP ring bw + own experts * (EP-1)/EP over the EP group.
"""

from __future__ import annotations

from dataclasses import dataclass

from lockstep.plan.cluster import DTYPE_BYTES, ClusterSpec, RolloutSpec, TrainSpec
from lockstep.plan.layout import Layout, group_ranks, peers, pp_crosses_nodes
from lockstep.plan.memory import per_gpu_params, stage_groups
from lockstep.plan.model import ModelSpec
from lockstep.plan.params import buffer_bytes
from lockstep.plan.rollout import push_bytes_per_param

A = 2.0


@dataclass(frozen=True)
class CommTerm:
    name: str
    bytes: float
    seconds: float
    formula: str


def _ring_bw(layout: Layout, dim: str, cluster: ClusterSpec) -> float:
    _, inter = peers(group_ranks(layout, dim), cluster.gpus_per_node)
    return cluster.inter_node_gbs * 1e9 if inter else cluster.intra_node_gbs * 1e9


def _a2a_seconds(nbytes: float, layout: Layout, dim: str, cluster: ClusterSpec) -> float:
    same, other = peers(group_ranks(layout, dim), cluster.gpus_per_node)
    total = max(same + other, 1)
    return max(nbytes * same / total / (cluster.intra_node_gbs * 1e9),
               nbytes * other / total / (cluster.inter_node_gbs * 1e9))


def tp_term(m, cluster, train, layout, mb, L, passes) -> CommTerm:
    g = layout.tp
    blocks = 1 + (1 if (not m.is_moe or m.n_shared_experts) else 0)
    nbytes = mb * L * blocks * passes * 2 * (g - 1) / g * train.max_tokens_per_gpu * m.hidden_size * A
    return CommTerm("TP all-reduce", nbytes, nbytes / _ring_bw(layout, "tp", cluster),
                    f"{mb} mb x {L} layers x {blocks} x {passes} passes x 2({g}-1)/{g} x t*H*2")


def ep_term(m, cluster, train, layout, mb, L, passes) -> CommTerm:
    e = layout.ep
    per = train.max_tokens_per_gpu / layout.tp * m.num_experts_per_tok * m.hidden_size * A * (e - 1) / e
    nbytes = mb * L * passes * 2 * per if m.is_moe else 0.0
    return CommTerm("EP all-to-all", nbytes, _a2a_seconds(nbytes, layout, "ep", cluster),
                    f"{mb} mb x {L} layers x {passes} passes x 2 x (t/TP)*k*H*2 x ({e}-1)/{e}")


def pp_term(m, cluster, train, layout, mb) -> CommTerm:
    nbytes = mb * 2 * train.max_tokens_per_gpu * m.hc_mult * m.hidden_size * A / layout.tp if layout.pp > 1 else 0.0
    bw = cluster.inter_node_gbs if pp_crosses_nodes(layout, cluster.gpus_per_node) else cluster.intra_node_gbs
    return CommTerm("PP send/recv", nbytes, nbytes / (bw * 1e9), f"{mb} mb x 2 x t*{m.hc_mult}*H*2 / TP")


def _kv_bytes_per_token(m: ModelSpec, tp: int) -> float:
    if m.family != "deepseek_v4":
        return 2 * m.num_kv_heads * m.head_dim * A / min(tp, m.num_kv_heads)
    extra = 0.0
    if 4 in m.compress_ratios:
        extra = (m.head_dim + m.index_head_dim) / 4
    return (m.head_dim + extra) * A


def cp_term(m, cluster, train, layout, mb, L, passes) -> CommTerm:
    c = layout.cp
    nbytes = mb * L * passes * (c - 1) * train.max_tokens_per_gpu * _kv_bytes_per_token(m, layout.tp)
    return CommTerm("CP K/V exchange", nbytes, nbytes / _ring_bw(layout, "cp", cluster),
                    f"{mb} mb x {L} layers x {passes} passes x ({c}-1) x t x kv bytes")


def dp_terms(m, cluster, train, layout, pd, pe) -> list[CommTerm]:
    """Gradient reduction / parameter gather, and the host traffic of optimizer offload."""
    pb, gb = DTYPE_BYTES[train.param_dtype], DTYPE_BYTES[train.grad_dtype]
    out, secs, total = [], 0.0, 0.0
    for p, dim, g in ((pd, "dpcp", layout.dp * layout.cp), (pe, "edp", layout.edp)):
        if g == 1 or p == 0:
            continue
        vol = (g - 1) / g * p * ((gb + pb) if train.distributed_optimizer else 2 * gb)
        total += vol
        secs += vol / _ring_bw(layout, dim, cluster)
    how = "RS grads + AG params" if train.distributed_optimizer else "all-reduce grads"
    out.append(CommTerm("DP gradient reduce", total, secs,
                        f"{how}: dense over DP*CP {layout.dp * layout.cp}, experts over EDP {layout.edp}"))
    if train.optimizer_offload:
        shard = pd / (layout.dp * layout.cp) + pe / layout.edp if train.distributed_optimizer else pd + pe
        vol = shard * (4 + pb)
        out.append(CommTerm("optimizer offload (host link)", vol, vol / (cluster.host_link_gbs * 1e9),
                            f"{shard / 1e9:.3f}B params x (4 B grad down + {pb:g} B param up)"))
    return out


def weight_push_term(m, cluster, rollout: RolloutSpec, layout: Layout, stages: list[range]) -> CommTerm:
    """Actor -> rollout push of the whole model (plus tid2eid / router bias buffers)."""
    intra, inter = cluster.intra_node_gbs * 1e9, cluster.inter_node_gbs * 1e9
    total, worst = buffer_bytes(m), buffer_bytes(m) / inter
    for s, layers in enumerate(stages):
        groups = stage_groups(m, layout, s, layers)
        stage = sum(g.count * push_bytes_per_param(g, rollout) for g in groups)
        experts = sum(g.count * push_bytes_per_param(g, rollout) for g in groups if g.shard == "expert")
        gather = (stage - experts) * (layout.tp - 1) / layout.tp / intra
        gather += _a2a_seconds(experts * (layout.ep - 1) / layout.ep, layout, "ep", cluster)
        worst = max(worst, gather + stage / inter)
        total += stage
    return CommTerm("weight push", total, worst,
                    f"{rollout.push_format}: {layout.pp} stage senders in parallel, gather + stage bytes / NIC")


def colocated_update_term(m, cluster, rollout: RolloutSpec, layout: Layout, stages: list[range]) -> CommTerm:
    """Colocated: the whole model gathered on every GPU for its engine (module docstring); the
    slowest stage's GPU decides."""
    per_stage = []
    for s, layers in enumerate(stages):
        groups = stage_groups(m, layout, s, layers)
        per_stage.append((sum(g.count * push_bytes_per_param(g, rollout) for g in groups),
                          sum(g.count * push_bytes_per_param(g, rollout) for g in groups if g.shard == "expert")))
    total = buffer_bytes(m) + sum(stage for stage, _ in per_stage)
    pp_bw = cluster.inter_node_gbs if pp_crosses_nodes(layout, cluster.gpus_per_node) else cluster.intra_node_gbs
    received, worst = 0.0, 0.0
    for stage, experts in per_stage:
        others, peers_experts = total - stage, experts * (layout.ep - 1) / layout.ep
        seconds = others / (pp_bw * 1e9)  # nothing when PP is 1: the GPU holds its whole stage
        seconds += _a2a_seconds(peers_experts, layout, "ep", cluster)
        if seconds >= worst:
            received, worst = others + peers_experts, seconds
    return CommTerm("weight push", received, worst,
                    f"{rollout.push_format}, colocated: the other stages over PP {layout.pp} + EP {layout.ep} peers' "
                    "experts, gathered on every GPU")


def step_comm(m: ModelSpec, cluster: ClusterSpec, train: TrainSpec, rollout: RolloutSpec, layout: Layout,
              stages: list[range]) -> list[CommTerm]:
    """Every communication term of one step (the largest stage for the per-layer ones)."""
    mb = train.micro_batches(layout.dp, layout.cp)
    L = max(len(r) for r in stages)
    passes = 3 if train.recompute else 2
    per_stage = [per_gpu_params(stage_groups(m, layout, s, r), layout) for s, r in enumerate(stages)]
    pd, pe = max(per_stage, key=lambda x: x[0] + x[1])
    terms = [tp_term(m, cluster, train, layout, mb, L, passes), ep_term(m, cluster, train, layout, mb, L, passes),
             pp_term(m, cluster, train, layout, mb), cp_term(m, cluster, train, layout, mb, L, passes)]
    terms += dp_terms(m, cluster, train, layout, pd, pe)
    push = colocated_update_term if cluster.colocate else weight_push_term
    terms.append(push(m, cluster, rollout, layout, stages))
    return terms
