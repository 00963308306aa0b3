"""Actor model-parallel layouts: validation, pipeline stages, enumeration, rank placement.

A layout is (TP, PP, EP, CP) on the actor GPUs; DP = actor_gpus / (TP * PP * CP). As in
Megatron with expert-tensor-parallel 1, the TP * CP * DP ranks of one pipeline stage are
re-factored for the MoE layers into EP * EDP, so EP must divide TP * CP * DP and
EDP = TP * CP * DP / EP.

Rank order (Megatron's default "tp-cp-ep-dp-pp"): dense rank = tp + TP*(cp + CP*(dp + DP*pp)),
expert rank = ep + EP*(edp + EDP*pp). GPU g lives on node g // gpus_per_node, so a group is
intra-node when its ranks share a node.

Pipeline stages: with `decoder_last_pipeline_num_layers = k` the last stage gets k layers and the
other PP - 1 stages share L - k evenly (Megatron's flag). Without it, L / PP each when PP divides L,
else the k that `auto_last_stage` picks: the most even split of that form whose last stage is the
lightest (it also holds the head), e.g. 43 layers on PP 4 -> 11, 11, 11, 10. The embedding sits on
stage 0 and the head on the last stage.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass

from lockstep.plan.cluster import ClusterSpec, TrainSpec
from lockstep.plan.model import ModelSpec

TP_CHOICES = (1, 2, 4, 8)
CP_CHOICES = (1, 2, 4)


class PlanError(ValueError):
    """A layout or input that cannot work, with a message naming the offending quantity."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int
    pp: int
    ep: int
    cp: int
    dp: int

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "cp", "dp"):
            if getattr(self, name) < 1:
                raise PlanError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def stage_gpus(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: TP * CP * DP / EP."""
        return self.stage_gpus // self.ep

    def label(self) -> str:
        return f"TP{self.tp} PP{self.pp} EP{self.ep} CP{self.cp} DP{self.dp}"


def auto_last_stage(num_layers: int, pp: int) -> int:
    """Layers of the last stage when none is given: L / PP if PP divides L, else the largest k whose
    other stages split L - k evenly with at least k layers each (the last stage also holds the head)."""
    if num_layers % pp == 0:
        return num_layers // pp
    fits = [k for k in range(1, num_layers // pp + 1) if (num_layers - k) % (pp - 1) == 0]
    if not fits:
        raise PlanError(f"{num_layers} layers do not split over PP {pp} with a last stage no heavier than the "
                        f"others; --decoder-last-pipeline-num-layers K sets one")
    return fits[-1]


def stage_layers(num_layers: int, pp: int, last: int | None) -> tuple[int, ...]:
    """Decoder layers per pipeline stage; raises PlanError when they do not split."""
    if pp < 1 or pp > num_layers:
        raise PlanError(f"PP {pp} must be between 1 and the {num_layers} layers")
    if pp == 1:
        return (num_layers,)
    if last is None:
        last = auto_last_stage(num_layers, pp)
    if last >= num_layers:
        raise PlanError(f"--decoder-last-pipeline-num-layers {last} must be smaller than the {num_layers} layers")
    rest = num_layers - last
    if rest % (pp - 1):
        raise PlanError(
            f"{num_layers} - {last} = {rest} layers are not divisible over PP - 1 = {pp - 1} stages "
            f"(--decoder-last-pipeline-num-layers {last})"
        )
    return (rest // (pp - 1),) * (pp - 1) + (last,)


def _check_tp(model: ModelSpec, cluster: ClusterSpec, tp: int) -> None:
    if tp > cluster.gpus_per_node:
        raise PlanError(f"TP {tp} spans nodes (--gpus-per-node {cluster.gpus_per_node})")
    divisible = {"attention heads": model.num_attention_heads}
    if model.family == "deepseek_v4":
        divisible["o_groups"] = model.o_groups
        if 4 in model.compress_ratios:
            divisible["indexer heads"] = model.index_n_heads
    elif model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise PlanError(f"TP {tp} and the {model.num_kv_heads} KV heads do not divide one another")
    for what, n in divisible.items():
        if n % tp:
            raise PlanError(f"TP {tp} does not divide the {n} {what}")


def _check_ep(model: ModelSpec, ep: int) -> None:
    experts = model.n_routed_experts
    if not model.is_moe and ep != 1:
        raise PlanError(f"EP {ep} needs routed experts; {model.name} is dense (use EP 1)")
    if model.is_moe and ep > experts:
        raise PlanError(f"EP {ep} is larger than the {experts} routed experts")
    if model.is_moe and experts % ep:
        raise PlanError(f"EP {ep} does not divide the {experts} routed experts")


def _check_ep_stage(layout: Layout) -> None:
    ep = layout.ep
    if layout.stage_gpus % ep:
        raise PlanError(f"EP {ep} does not divide TP*CP*DP = {layout.stage_gpus} GPUs of a pipeline stage")


def _check_cp(train: TrainSpec, cp: int) -> None:
    if cp > 1 and train.seq_len % (2 * cp):
        raise PlanError(f"--seq-len {train.seq_len} is not divisible by 2*CP = {2 * cp} (load-balanced CP)")
    if train.seq_len > train.max_tokens_per_gpu * cp:
        raise PlanError(
            f"a {train.seq_len}-token sequence does not fit a micro-batch of --max-tokens-per-gpu "
            f"{train.max_tokens_per_gpu} x CP {cp}"
        )


def make_layout(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, *, tp: int, pp: int, ep: int,
                cp: int) -> Layout:
    """Validate (TP, PP, EP, CP) against the model and cluster; raise PlanError with the reason."""
    # each dimension's own checks first, so that a search with one fixed dimension reports that one
    _check_tp(model, cluster, tp)
    stage_layers(model.num_layers, pp, train.decoder_last_pipeline_num_layers)
    _check_ep(model, ep)
    _check_cp(train, cp)
    world = cluster.actor_gpus
    if world % (tp * pp * cp):
        raise PlanError(f"TP*PP*CP = {tp}*{pp}*{cp} does not divide the {world} actor GPUs "
                        f"(--actor-nodes {cluster.actor_nodes} x --gpus-per-node {cluster.gpus_per_node})")
    layout = Layout(tp=tp, pp=pp, ep=ep, cp=cp, dp=world // (tp * pp * cp))
    _check_ep_stage(layout)
    return layout


def _ep_choices(model: ModelSpec, world: int) -> list[int]:
    """1 and powers of two up to min(experts, world)."""
    if not model.is_moe:
        return [1]
    out, ep = [], 1
    while ep <= min(model.n_routed_experts, world):
        out.append(ep)
        ep *= 2
    return out


def enumerate_layouts(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, *, tp=None, pp=None, ep=None,
                      cp=None) -> list[Layout]:
    """Every valid layout; a fixed dimension (not None) restricts the search to that value.

    When all four are fixed the single layout is validated and its PlanError propagates, so a
    request like `--tp 16` fails with the reason instead of an empty table; when a partly fixed
    search finds nothing, the PlanError lists the reasons the candidates failed, most common first.
    """
    world = cluster.actor_gpus
    if None not in (tp, pp, ep, cp):
        return [make_layout(model, cluster, train, tp=tp, pp=pp, ep=ep, cp=cp)]
    tps = [tp] if tp else [t for t in TP_CHOICES if t <= cluster.gpus_per_node]
    pps = [pp] if pp else range(1, min(model.num_layers, world) + 1)
    eps = [ep] if ep else _ep_choices(model, world)
    cps = [cp] if cp else CP_CHOICES
    out, reasons, example = [], Counter(), {}
    for t, p, e, c in itertools.product(tps, pps, eps, cps):
        try:
            out.append(make_layout(model, cluster, train, tp=t, pp=p, ep=e, cp=c))
        except PlanError as err:
            kind = re.sub(r"\d+", "N", str(err))  # one entry per check, whatever the sizes
            reasons[kind] += 1
            example.setdefault(kind, str(err))
    if not out and reasons:
        top = "; ".join(f"{example[k]} ({n} layout{'s' if n > 1 else ''})" for k, n in reasons.most_common(3))
        raise PlanError(f"none of the {sum(reasons.values())} layouts searched is valid: {top}")
    return out


def peers(ranks: list[int], gpus_per_node: int) -> tuple[int, int]:
    """(same-node peers, other-node peers) of ranks[0] within the group `ranks`."""
    node = ranks[0] // gpus_per_node
    same = sum(1 for r in ranks[1:] if r // gpus_per_node == node)
    return same, len(ranks) - 1 - same


def group_ranks(layout: Layout, dim: str) -> list[int]:
    """Ranks of the group through rank 0 along `dim` (tp, cp, dp, dpcp, ep, edp)."""
    t, c, d, e = layout.tp, layout.cp, layout.dp, layout.ep
    if dim == "tp":
        return list(range(t))
    if dim == "cp":
        return [i * t for i in range(c)]
    if dim == "dp":
        return [i * t * c for i in range(d)]
    if dim == "dpcp":
        return [i * t for i in range(c * d)]
    if dim == "ep":
        return list(range(e))
    if dim == "edp":
        return [i * e for i in range(layout.edp)]
    raise ValueError(f"unknown group dimension {dim!r}")


def pp_crosses_nodes(layout: Layout, gpus_per_node: int) -> bool:
    """Whether any pipeline boundary sends from one node to another."""
    s = layout.stage_gpus
    return any((k * s) // gpus_per_node != ((k + 1) * s) // gpus_per_node for k in range(layout.pp - 1))
