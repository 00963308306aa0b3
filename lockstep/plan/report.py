"""Render plans: a ranked rich table, the itemised terms of one layout, or JSON.

JSON (`to_json`): a list, one object per layout in rank order, with tp, pp, ep, cp, dp, edp,
feasible, train_flags (the `lockstep train` flags that realise the layout, null when lockstep cannot
run it) and not_runnable (why not, else empty; lockstep/plan/train_flags.py), actor_gb_per_gpu (worst pipeline stage), rollout_gb_per_gpu, host_gb_per_node, reason
(empty when feasible), step_seconds and its parts, the weight push, every memory and
communication term so the numbers can be checked by hand, and (given the model)
rollout_weight_formats: one copy of the model's weights per --rollout-weight-format,
{"bf16" | "fp8" | "native": {"label", "bytes", "ratio" (of bf16)}}, the same in every object (the
list is what `lockstep train --layout` reads, so the model-level table rides on each layout).
"""

from __future__ import annotations

import json

from rich import box
from rich.console import Console
from rich.table import Table

from lockstep.plan import activations as act
from lockstep.plan.cluster import GB, HOST_MEMORY_GB, ClusterSpec, TrainSpec
from lockstep.plan.memory import phase_gpu_bytes
from lockstep.plan.model import ModelSpec
from lockstep.plan.params import active_params, total_params
from lockstep.plan.planner import LayoutPlan
from lockstep.plan.rollout import weight_formats
from lockstep.plan.train_flags import train_flags


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


def plan_flags(p: LayoutPlan, cluster: ClusterSpec, train: TrainSpec) -> tuple[list[str] | None, str]:
    """train_flags of a planned layout: its engines' GPUs and last stage's layers from the plan."""
    return train_flags(p.layout, cluster, train, engine_gpus=cluster.rollout_gpus // p.rollout.engines,
                       last_stage_layers=len(p.stages[-1].layers))


def plan_dict(p: LayoutPlan, cluster: ClusterSpec | None = None, train: TrainSpec | None = None) -> dict:
    lay, worst, push = p.layout, p.worst, p.comm_term("weight push")
    flags, not_runnable = plan_flags(p, cluster, train) if cluster and train else (None, "")
    return {
        "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "cp": lay.cp, "dp": lay.dp, "edp": lay.edp,
        "feasible": p.feasible, "colocate": bool(cluster and cluster.colocate),
        **({"train_flags": flags, "not_runnable": not_runnable} if cluster and train else {}),
        "actor_gb_per_gpu": _r(p.actor_bytes / GB),
        "rollout_gb_per_gpu": _r(p.rollout.gpu_bytes / GB),
        "usable_gb_per_gpu": _r(p.usable_bytes / GB),
        "host_gb_per_node": _r(p.host_bytes_per_node / GB),
        "reason": p.reason,
        "worst_stage": worst.stage,
        "stage_layers": [len(s.layers) for s in p.stages],
        # per stage, the GPU's GB in each phase (memory.phase_gpu_bytes): what a run's per-phase peaks meet
        "stage_phase_gb": [{k: _r(v / GB) for k, v in phase_gpu_bytes(s.terms).items()} for s in p.stages],
        "step_seconds": _r(p.step_seconds),
        "compute_seconds": _r(p.compute_s),
        "pipeline_bubble": _r(p.bubble),
        "weight_push_bytes": int(push.bytes),
        "weight_push_seconds": _r(push.seconds),
        "actor_terms_gb": {t.name: _r(t.bytes / GB) for t in worst.terms},
        "rollout_terms_gb": {t.name: _r(t.bytes / GB) for t in p.rollout.terms},
        "comm": {c.name: {"bytes": int(c.bytes), "seconds": _r(c.seconds, 4)} for c in p.comm},
    }


def formats_dict(model: ModelSpec) -> dict:
    """The JSON of `weight_formats`: {format: {"label", "bytes", "ratio"}}."""
    return {f.format: {"label": f.label, "bytes": int(f.bytes), "ratio": _r(f.ratio, 4)} for f in weight_formats(model)}


def to_json(plans: list[LayoutPlan], cluster: ClusterSpec | None = None, train: TrainSpec | None = None,
            model: ModelSpec | None = None) -> str:
    """The layouts (module docstring); with `model`, each carries rollout_weight_formats."""
    extra = {"rollout_weight_formats": formats_dict(model)} if model else {}
    return json.dumps([{**plan_dict(p, cluster, train), **extra} for p in plans], indent=2)


def formats_table(model: ModelSpec) -> Table:
    """One copy of the whole model's weights in each rollout weight format, against bf16."""
    t = Table(title="Rollout weights per format", caption="one copy of the whole model", box=BOX)
    t.add_column("format")
    for col in ("GB", "bytes", "x bf16"):
        t.add_column(col, justify="right", no_wrap=True)
    for f in weight_formats(model):
        t.add_row(f.label, f"{f.bytes / GB:.2f}", f"{f.bytes:,.0f}", f"{f.ratio:.3f}")
    return t


def flags_line(p: LayoutPlan, cluster: ClusterSpec, train: TrainSpec) -> str:
    """`lockstep train ...` for the layout, or why lockstep cannot run it yet."""
    flags, why = plan_flags(p, cluster, train)
    if flags is None:
        return f"lockstep train cannot run {p.layout.label()} yet: {why}"
    return f"Run {p.layout.label()} with: lockstep train --model DIR {' '.join(flags)}"


def _secs(p: LayoutPlan, name: str) -> str:
    term = next((c for c in p.comm if c.name == name), None)
    return f"{term.seconds:.2f}" if term else "-"


# the per-term seconds: only in the wide table (about 200 columns with them, 110 without)
WIDE_ONLY = ("compute s", "TP s", "EP s", "PP s", "CP s", "DP s", "host s")
BOX = box.SIMPLE_HEAD  # no vertical rules: 3 columns fewer per table column than rich's default
WIDE_COLUMNS = 200  # a terminal at least this wide gets the wide table without --wide


def _row(i: int, p: LayoutPlan) -> dict[str, str]:
    return {"#": str(i), "layout": p.layout.label(), "fits": "yes" if p.feasible else "[red]no[/red]",
            "actor GB": f"{p.actor_bytes / GB:.1f}", "host GB": f"{p.host_bytes_per_node / GB:.0f}",
            "rollout GB": f"{p.rollout.gpu_bytes / GB:.1f}", "step s": f"{p.step_seconds:.2f}",
            "compute s": f"{p.compute_s * (1 + p.bubble):.2f}", "TP s": _secs(p, "TP all-reduce"),
            "EP s": _secs(p, "EP all-to-all"), "PP s": _secs(p, "PP send/recv"), "CP s": _secs(p, "CP K/V exchange"),
            "DP s": _secs(p, "DP gradient reduce"), "host s": _secs(p, "optimizer offload (host link)"),
            "push s": _secs(p, "weight push"), "breaks on": p.reason}


def table(plans: list[LayoutPlan], limit: int | None = None, wide: bool = True) -> Table:
    """The ranked layouts; `wide` adds the seconds of every communication term."""
    t = Table(title="Layouts ranked by estimated step time (no compute/communication overlap assumed); "
                    "actor and rollout GB per GPU, host GB per node", box=BOX)
    rows = [_row(i, p) for i, p in enumerate(plans[:limit] if limit else plans, 1)]
    columns = [c for c in _row(0, plans[0]) if wide or c not in WIDE_ONLY] if plans else []
    for col in columns:
        t.add_column(col, justify="left" if col in ("layout", "breaks on") else "right", no_wrap=col != "breaks on")
    for row in rows:
        t.add_row(*(row[c] for c in columns))
    return t


def terms_table(p: LayoutPlan) -> Table:
    """Every memory term of every stage, the rollout GPU and the communication of one layout; each
    group names where it is once, on its first row (narrow terminals keep the formulas readable)."""
    t = Table(title=f"Terms of {p.layout.label()} (usable {p.usable_bytes / GB:.1f} GB per GPU)", box=BOX)
    t.add_column("where", no_wrap=True)
    t.add_column("term")
    t.add_column("GB", justify="right", no_wrap=True)
    t.add_column("seconds", justify="right", no_wrap=True)
    t.add_column("formula")
    groups = [(f"actor stage {s.stage}, {len(s.layers)} layers", s.terms, s.gpu_bytes) for s in p.stages]
    groups.append(("rollout GPU", p.rollout.terms, p.rollout.gpu_bytes))
    for where, terms, total in groups:
        for i, term in enumerate(terms):
            t.add_row(where if i == 0 else "", term.name, f"{term.bytes / GB:.2f}", "", term.formula)
        t.add_row("", "[bold]total on GPU[/bold]", f"[bold]{total / GB:.2f}[/bold]", "", "", end_section=True)
    for i, c in enumerate(p.comm):
        t.add_row("per step" if i == 0 else "", c.name, f"{c.bytes / GB:.2f}", f"{c.seconds:.3f}", c.formula)
    t.add_row("", "compute (x bubble)", "", f"{p.compute_s * (1 + p.bubble):.3f}",
              f"{p.compute_s:.3f} s x (1 + {p.bubble:.3f})")
    return t


def activation_table(model: ModelSpec, tp: int, seq_len: int) -> Table:
    """Saved activations per token of one layer of each attention kind, tensor by tensor."""
    kinds = {}
    for i in range(model.num_layers):
        kinds.setdefault(model.layer_kind(i), i)
    t = Table(title=f"Activations saved per token per layer (bytes, TP {tp}, {seq_len}-token sequences; split terms "
                    "divided by TP)")
    t.add_column("tensor")
    t.add_column("split", justify="center")
    for ratio, i in kinds.items():
        t.add_column(f"layer {i} ({'C' + str(ratio) if ratio else 'window/full'})", justify="right")
    names = list(dict.fromkeys(a.name for i in kinds.values() for a in act.layer_terms(model, i, seq_len)))
    for name in names:
        cells, split = [], ""
        for i in kinds.values():
            term = next((a for a in act.layer_terms(model, i, seq_len) if a.name == name), None)
            split = split or ("yes" if term and term.split else "no" if term else "")
            cells.append(f"{term.bytes_per_token / (tp if term.split else 1):.0f}" if term else "")
        t.add_row(name, split, *cells)
    t.add_row("[bold]total[/bold]", "", *[f"[bold]{act.layer_bytes_per_token(model, i, tp, seq_len):.0f}[/bold]"
                                          for i in kinds.values()])
    t.add_row("with full recompute", "yes", *[f"{act.recompute_bytes_per_token(model, tp):.0f}"] * len(kinds))
    return t


def assumptions(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plans: list[LayoutPlan]) -> list[str]:
    """What the plan assumed that the user did not say: uneven pipeline stages, the host memory checked."""
    out = []
    splits = {p.layout.pp: [len(s.layers) for s in p.stages] for p in plans}
    uneven = {pp: n for pp, n in splits.items() if len(set(n)) > 1}
    if uneven and train.decoder_last_pipeline_num_layers is None:
        splits = ", ".join(f"PP{pp} {'/'.join(map(str, n))}" for pp, n in sorted(uneven.items()))
        out.append(f"Pipeline stages: PP that does not divide the {model.num_layers} layers gets a lighter last stage "
                   f"({splits}); --decoder-last-pipeline-num-layers K fixes the last stage at K layers.")
    if cluster.colocate:
        out.append("Colocated: every GPU holds its actor stage and its engine (the \"engine: ...\" terms); the train "
                   "step's transient terms and the engine's generation or weight update never peak together. The "
                   "rollout GPU rows show the engine's part alone.")
    if cluster.host_memory_gb is None:
        out.append("Host memory: not checked.")
    elif train.optimizer_offload:
        how = " (the default: an 8 x H200 DGX node's 2 TB)" if cluster.host_memory_gb == HOST_MEMORY_GB else ""
        out.append(f"Host memory: {cluster.host_memory_gb:.0f} GB per node{how} holds the offloaded optimizer; "
                   "set it with --host-memory-gb.")
    return out


def render(plans: list[LayoutPlan], model: ModelSpec, console: Console, limit: int | None = None,
           detail: LayoutPlan | None = None, activations: bool = False, wide: bool = True,
           notes: list[str] | tuple[str, ...] = (), cluster: ClusterSpec | None = None,
           train: TrainSpec | None = None) -> None:
    """Header, ranked table (`wide`: with every communication term), the itemised terms of `detail`
    (default: the best layout), the model's rollout weights per format (`formats_table`), on request
    the per-token activation breakdown for that layout's TP, the `lockstep train` flags of the best
    feasible layout (given `cluster` and `train`) and `notes` (what was assumed, see `assumptions`)."""
    console.print(f"[bold]{model.name}[/bold]: {total_params(model) / 1e9:.2f}B parameters, "
                  f"{active_params(model) / 1e9:.2f}B active per token, {model.num_layers} layers")
    console.print(table(plans, limit, wide))
    feasible = [p for p in plans if p.feasible]
    chosen = detail or (feasible[0] if feasible else plans[0])
    console.print(terms_table(chosen))
    console.print(formats_table(model))
    if activations and train:  # the attention terms grow with the sequence length
        console.print(activation_table(model, chosen.layout.tp, train.seq_len))
    console.print(recommendation(plans))
    if feasible and cluster and train:
        console.print(flags_line(feasible[0], cluster, train), markup=False)
    for note in notes:
        console.print(note)


def spare(p: LayoutPlan) -> float:
    """GB left on the tighter actor GPU."""
    return (p.usable_bytes - p.actor_bytes) / GB


def recommendation(plans: list[LayoutPlan], within: float = 0.05) -> str:
    """The fastest feasible layout, and the roomiest one whose estimate is within 5% of it."""
    feasible = [p for p in plans if p.feasible]
    if not feasible:
        return "No layout fits; the table says which term breaks each one."
    best = feasible[0]
    text = (f"Choose {best.layout.label()}: estimated {best.step_seconds:.2f} s per step, "
            f"{spare(best):.1f} GB to spare per actor GPU.")
    close = [p for p in feasible if p.step_seconds <= best.step_seconds * (1 + within)]
    roomy = max(close, key=spare)
    if roomy is not best:
        text += (f" Within {within:.0%} of it, {roomy.layout.label()} ({roomy.step_seconds:.2f} s) leaves "
                 f"{spare(roomy):.1f} GB: prefer it if the memory estimate may be short.")
    return text
