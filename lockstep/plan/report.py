"""Render plans: a ranked rich table, the itemised terms of one layout, or JSON.

JSON (`to_json`): a list, one object per layout in rank order, with tp, pp, ep, cp, dp, edp,
feasible, actor_gb_per_gpu (worst pipeline stage), rollout_gb_per_gpu, host_gb_per_node, reason
(empty when feasible), step_seconds and its parts, the weight push, and every memory and
communication term so the numbers can be checked by hand.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from lockstep.plan import activations as act
from lockstep.plan.cluster import GB
from lockstep.plan.model import ModelSpec
from lockstep.plan.params import active_params, total_params
from lockstep.plan.planner import LayoutPlan


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


def plan_dict(p: LayoutPlan) -> dict:
    lay, worst, push = p.layout, p.worst, p.comm_term("weight push")
    return {
        "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "cp": lay.cp, "dp": lay.dp, "edp": lay.edp,
        "feasible": p.feasible,
        "actor_gb_per_gpu": _r(p.actor_bytes / GB),
        "rollout_gb_per_gpu": _r(p.rollout.gpu_bytes / GB),
        "usable_gb_per_gpu": _r(p.usable_bytes / GB),
        "host_gb_per_node": _r(p.host_bytes_per_node / GB),
        "reason": p.reason,
        "worst_stage": worst.stage,
        "stage_layers": [len(s.layers) for s in p.stages],
        "step_seconds": _r(p.step_seconds),
        "compute_seconds": _r(p.compute_s),
        "pipeline_bubble": _r(p.bubble),
        "weight_push_bytes": int(push.bytes),
        "weight_push_seconds": _r(push.seconds),
        "actor_terms_gb": {t.name: _r(t.bytes / GB) for t in worst.terms},
        "rollout_terms_gb": {t.name: _r(t.bytes / GB) for t in p.rollout.terms},
        "comm": {c.name: {"bytes": int(c.bytes), "seconds": _r(c.seconds, 4)} for c in p.comm},
    }


def to_json(plans: list[LayoutPlan]) -> str:
    return json.dumps([plan_dict(p) for p in plans], indent=2)


def _secs(p: LayoutPlan, name: str) -> str:
    term = next((c for c in p.comm if c.name == name), None)
    return f"{term.seconds:.2f}" if term else "-"


def table(plans: list[LayoutPlan], limit: int | None = None) -> Table:
    t = Table(title="Layouts ranked by estimated step time (no compute/communication overlap assumed)")
    for col in ("#", "layout", "fits", "actor GB/GPU", "rollout GB/GPU", "step s", "compute s", "TP s", "EP s",
                "PP s", "CP s", "DP s", "host s", "push s", "breaks on"):
        t.add_column(col, justify="left" if col in ("layout", "breaks on") else "right", no_wrap=col == "layout")
    for i, p in enumerate(plans[:limit] if limit else plans, 1):
        t.add_row(str(i), p.layout.label(), "yes" if p.feasible else "[red]no[/red]",
                  f"{p.actor_bytes / GB:.1f}", f"{p.rollout.gpu_bytes / GB:.1f}", f"{p.step_seconds:.2f}",
                  f"{p.compute_s * (1 + p.bubble):.2f}", _secs(p, "TP all-reduce"), _secs(p, "EP all-to-all"),
                  _secs(p, "PP send/recv"), _secs(p, "CP K/V exchange"), _secs(p, "DP gradient reduce"),
                  _secs(p, "optimizer offload (host link)"), _secs(p, "weight push"), p.reason)
    return t


def terms_table(p: LayoutPlan) -> Table:
    """Every memory term of every stage, the rollout GPU and the communication of one layout."""
    t = Table(title=f"Terms of {p.layout.label()} (usable {p.usable_bytes / GB:.1f} GB per GPU)")
    t.add_column("where")
    t.add_column("term")
    t.add_column("GB", justify="right")
    t.add_column("seconds", justify="right")
    t.add_column("formula")
    for s in p.stages:
        where = f"actor stage {s.stage} ({len(s.layers)} layers)"
        for term in s.terms:
            t.add_row(where, term.name, f"{term.bytes / GB:.2f}", "", term.formula)
        t.add_row(where, "[bold]total on GPU[/bold]", f"[bold]{s.gpu_bytes / GB:.2f}[/bold]", "", "")
    for term in p.rollout.terms:
        t.add_row("rollout GPU", term.name, f"{term.bytes / GB:.2f}", "", term.formula)
    t.add_row("rollout GPU", "[bold]total on GPU[/bold]", f"[bold]{p.rollout.gpu_bytes / GB:.2f}[/bold]", "", "")
    for c in p.comm:
        t.add_row("per step", c.name, f"{c.bytes / GB:.2f}", f"{c.seconds:.3f}", c.formula)
    t.add_row("per step", "compute (x bubble)", "", f"{p.compute_s * (1 + p.bubble):.3f}",
              f"{p.compute_s:.3f} s x (1 + {p.bubble:.3f})")
    return t


def activation_table(model: ModelSpec, tp: int) -> Table:
    """Saved activations per token of one layer of each attention kind, tensor by tensor."""
    kinds = {}
    for i in range(model.num_layers):
        kinds.setdefault(model.layer_kind(i), i)
    t = Table(title=f"Activations saved per token per layer (bytes, TP {tp}; split terms divided by TP)")
    t.add_column("tensor")
    t.add_column("split", justify="center")
    for ratio, i in kinds.items():
        t.add_column(f"layer {i} ({'C' + str(ratio) if ratio else 'window/full'})", justify="right")
    names = list(dict.fromkeys(a.name for i in kinds.values() for a in act.layer_terms(model, i)))
    for name in names:
        cells, split = [], ""
        for i in kinds.values():
            term = next((a for a in act.layer_terms(model, i) if a.name == name), None)
            split = split or ("yes" if term and term.split else "no" if term else "")
            cells.append(f"{term.bytes_per_token / (tp if term.split else 1):.0f}" if term else "")
        t.add_row(name, split, *cells)
    t.add_row("[bold]total[/bold]", "", *[f"[bold]{act.layer_bytes_per_token(model, i, tp):.0f}[/bold]"
                                          for i in kinds.values()])
    t.add_row("with full recompute", "yes", *[f"{act.recompute_bytes_per_token(model, tp):.0f}"] * len(kinds))
    return t


def render(plans: list[LayoutPlan], model: ModelSpec, console: Console, limit: int | None = None,
           detail: LayoutPlan | None = None, activations: bool = False) -> None:
    """Header, ranked table, the itemised terms of `detail` (default: the best layout) and, on
    request, the per-token activation breakdown for that layout's TP."""
    console.print(f"[bold]{model.name}[/bold]: {total_params(model) / 1e9:.2f}B parameters, "
                  f"{active_params(model) / 1e9:.2f}B active per token, {model.num_layers} layers")
    console.print(table(plans, limit))
    feasible = [p for p in plans if p.feasible]
    chosen = detail or (feasible[0] if feasible else plans[0])
    console.print(terms_table(chosen))
    if activations:
        console.print(activation_table(model, chosen.layout.tp))
    console.print(recommendation(plans))


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
