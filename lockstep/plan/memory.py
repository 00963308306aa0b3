"""Actor memory per GPU, term by term, for each pipeline stage (Megatron-style training).

For the stage's parameters on one GPU, P = Pd + Pe with
  Pd = sum(tp groups) / TP + sum(replicated groups) + sum(vocab groups) / TP   (dense),
  Pe = sum(expert groups) / EP                                                   (routed experts),
the terms are
  weights     P * param_bytes                         (bf16: 2 B; full copy, not sharded)
  reference weights   P * param_bytes                 (only with the KL loss: the frozen reference model,
              sharded as the actor and kept on the GPU as lockstep's trainer does; its forward takes
              no gradient, so it adds no activations beyond one micro-batch's transient working set)
  gradients   P * grad_bytes                          (grad_dtype: fp32 4 B by default, Megatron's main
              grads; lockstep's bf16 trainer keeps bf16 .grad, freed after each step)
  optimizer   (Pd / (DP*CP) + Pe / EDP) * (4 + 2*state_bytes)   with the distributed optimizer
              (fp32 master + Adam m, v = 12 B per param), P * 12 B without it; with offload the
              same bytes live in host memory plus a host copy of the gradient shard for the CPU step
  activations inflight * layers * t * bytes_per_token(layer)   (see activations.py), where
              t = max_tokens_per_gpu and inflight = min(PP - stage, micro-batches) under 1F1B
  recompute working set   t * max layer bytes_per_token        (one layer rebuilt in backward)
  MoE dispatch buffers    t * 2 * k * H * 2 / TP   (EP > 1 only: with EP 1 no rows are exchanged)
  logits (last stage)     t * head_bytes_per_token + the head weight's fp32 gradient V/TP * H * (4 + 2) (activations.py)
The peak is the sum, except that with one micro-batch per GPU the gradients and the activation
terms are phases (`peak_gpu_bytes`): lockstep's backward allocates the gradients as it frees the
activations, so the peak holds the larger of the two. Colocated (ClusterSpec.colocate), the GPU
also serves between train steps: gradients and activations are then a "train" phase (with one
micro-batch, its two sub-phases), which never meets the engine's generation or weight update.
A layout fits when the worst stage's peak is within gpu_memory * (1 - reserve).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lockstep.plan import activations as act
from lockstep.plan.cluster import DTYPE_BYTES, GB, ClusterSpec, TrainSpec
from lockstep.plan.layout import Layout, stage_layers
from lockstep.plan.model import ModelSpec
from lockstep.plan.params import ParamGroup, embed_groups, head_groups, layer_groups


@dataclass(frozen=True)
class MemoryTerm:
    name: str
    bytes: float
    formula: str
    where: str = "gpu"  # "gpu" or "host"
    phase: str = ""  # "" always held; terms of different named phases are never held at once


def phase_gpu_bytes(terms) -> dict[str, float]:
    """The GPU's bytes in each phase: {"held": the always-held terms, phase: held + that phase's terms}
    (the one rule for the phases: the actor's forward/backward vs its gradients, the engine's
    generation vs its push, colocated the train step vs the engine's)."""
    gpu = [t for t in terms if t.where == "gpu"]
    held = sum(t.bytes for t in gpu if not t.phase)
    out = {"held": held}
    for t in gpu:
        if t.phase:
            out[t.phase] = out.get(t.phase, held) + t.bytes
    return out


def peak_gpu_bytes(terms) -> float:
    """The GPU's peak: every always-held term plus the largest phase's terms."""
    return max(phase_gpu_bytes(terms).values())


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: tuple[int, ...]  # decoder layer indices on this stage
    terms: tuple[MemoryTerm, ...]

    @property
    def gpu_bytes(self) -> float:
        return peak_gpu_bytes(self.terms)

    @property
    def host_bytes(self) -> float:
        return sum(t.bytes for t in self.terms if t.where == "host")

    def largest(self) -> MemoryTerm:
        return max((t for t in self.terms if t.where == "gpu"), key=lambda t: t.bytes)


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB"


def stage_layer_indices(model: ModelSpec, layout: Layout, last: int | None) -> list[range]:
    """Decoder layer indices of every pipeline stage."""
    out, start = [], 0
    for n in stage_layers(model.num_layers, layout.pp, last):
        out.append(range(start, start + n))
        start += n
    return out


def stage_groups(model: ModelSpec, layout: Layout, stage: int, layers: range) -> list[ParamGroup]:
    """Parameter groups held by one pipeline stage (embedding on stage 0, head on the last)."""
    out = embed_groups(model) if stage == 0 else []
    for i in layers:
        out += layer_groups(model, i)
    if stage == layout.pp - 1:
        heads = head_groups(model)
        if model.tie_word_embeddings and layout.pp == 1:
            heads = [g for g in heads if g.name != "head"]
        out += heads
    return out


def per_gpu_params(groups: list[ParamGroup], layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters on one GPU: tp and vocab groups / TP, experts / EP."""
    dense = sum(g.count / layout.tp if g.shard in ("tp", "vocab") else g.count
                for g in groups if g.shard != "expert")
    expert = sum(g.count / layout.ep for g in groups if g.shard == "expert")
    return dense, expert


def _transient(single: bool, sub_phase: str, colocate: bool) -> str:
    """The phase of a term that only the train step holds: with one micro-batch its own sub-phase
    (gradients vs activations); else, colocated, the train step's ("train"); else always held ("")."""
    return sub_phase if single else ("train" if colocate else "")


def _state_terms(pd: float, pe: float, train: TrainSpec, layout: Layout, colocate: bool = False) -> list[MemoryTerm]:
    pb, gb, ob = DTYPE_BYTES[train.param_dtype], DTYPE_BYTES[train.grad_dtype], train.optimizer_bytes_per_param
    p = pd + pe
    # lockstep's trainer keeps no gradient buffer: the backward allocates each gradient as it frees
    # the activations it consumed, and the optimiser clears them after the step (train/optimizer.py
    # zero_grad). With one micro-batch per GPU the two never peak together (1 micro-batch: phases);
    # with more, the next micro-batch's forward runs beside the accumulated gradients.
    single = train.micro_batches(layout.dp, layout.cp) == 1
    terms = [
        MemoryTerm("weights", p * pb, f"({pd / 1e9:.3f}B dense + {pe / 1e9:.3f}B expert) params x {pb:g} B"),
        MemoryTerm("gradients", p * gb, f"{p / 1e9:.3f}B params x {gb:g} B ({train.grad_dtype})"
                   + ("; 1 micro-batch: max with the activations" if single else ""),
                   phase=_transient(single, "gradients", colocate)),
    ]
    if train.use_kl_loss:
        terms.append(MemoryTerm("reference weights", p * pb, f"{p / 1e9:.3f}B params x {pb:g} B (KL reference)"))
    if train.distributed_optimizer:
        shard = pd / (layout.dp * layout.cp) + pe / layout.edp
        how = f"({pd / 1e9:.3f}B / DP*CP {layout.dp * layout.cp} + {pe / 1e9:.3f}B / EDP {layout.edp})"
    else:
        shard, how = p, f"{p / 1e9:.3f}B (not distributed)"
    formula = f"{how} x {ob:g} B (master + m + v)"
    if train.optimizer_offload:
        terms.append(MemoryTerm("optimizer states (offloaded)", 0.0, f"on host: {_gb(shard * ob)}"))
        terms.append(MemoryTerm("host: optimizer states", shard * ob, formula, "host"))
        terms.append(MemoryTerm("host: gradient shard", shard * 4, f"{shard / 1e9:.3f}B x 4 B (fp32 for CPU Adam)",
                                "host"))
    else:
        terms.append(MemoryTerm("optimizer states", shard * ob, formula))
    return terms


def _activation_terms(model: ModelSpec, train: TrainSpec, layout: Layout, stage: int,
                      layers: range, colocate: bool = False) -> list[MemoryTerm]:
    t, tp = train.max_tokens_per_gpu, layout.tp
    mbs = train.micro_batches(layout.dp, layout.cp)
    inflight = min(layout.pp - stage, mbs)
    full = [act.layer_bytes_per_token(model, i, tp, train.seq_len) for i in layers]
    terms = []
    if train.recompute:
        per = act.recompute_bytes_per_token(model, tp)
        terms.append(MemoryTerm("activations (recompute: layer inputs)", inflight * len(full) * t * per,
                                f"{inflight} mb x {len(full)} layers x {t} tok x {per / 1e3:.1f} KB"))
        if full:
            terms.append(MemoryTerm("recompute working set", t * max(full),
                                    f"1 layer x {t} tok x {max(full) / 1e3:.1f} KB"))
    else:
        avg = sum(full) / max(len(full), 1)
        terms.append(MemoryTerm("activations", inflight * t * sum(full),
                                f"{inflight} mb x {len(full)} layers x {t} tok x {avg / 1e3:.1f} KB"))
    disp = act.dispatch_bytes_per_token(model, tp)
    if disp and full and layout.ep > 1:  # EP 1 exchanges nothing: its rows are moe.dispatched
        terms.append(MemoryTerm("MoE dispatch buffers", t * disp, f"{t} tok x {disp / 1e3:.1f} KB (send + recv)"))
    if stage == layout.pp - 1:
        lg, w = act.head_bytes_per_token(model, tp), act.head_weight_grad_bytes(model, tp)
        terms.append(MemoryTerm("logits", t * lg + w, f"{t} tok x {lg / 1e3:.1f} KB (head, V/TP {model.vocab_size // tp}"
                                f" fp32 x {act.HEAD_FP32_ROWS}) + head weight gradient {w / 1e9:.2f} GB"))
    phase = _transient(mbs == 1, "activations", colocate)  # see _state_terms
    return [replace(x, phase=phase) for x in terms]


def stage_memory(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, layout: Layout, stage: int,
                 layers: range) -> StageMemory:
    """All memory terms of one GPU of pipeline stage `stage`."""
    pd, pe = per_gpu_params(stage_groups(model, layout, stage, layers), layout)
    terms = _state_terms(pd, pe, train, layout, cluster.colocate)
    terms += _activation_terms(model, train, layout, stage, layers, cluster.colocate)
    return StageMemory(stage=stage, layers=tuple(layers), terms=tuple(terms))


def actor_memory(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, layout: Layout) -> list[StageMemory]:
    """Memory of one GPU in every pipeline stage."""
    ranges = stage_layer_indices(model, layout, train.decoder_last_pipeline_num_layers)
    return [stage_memory(model, cluster, train, layout, s, r) for s, r in enumerate(ranges)]


def worst_stage(stages: list[StageMemory]) -> StageMemory:
    return max(stages, key=lambda s: s.gpu_bytes)
