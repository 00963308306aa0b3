"""A plan's memory per stage and phase against what a run measured (issue 19: error in % per stage).

The plan (`lockstep plan --json`, one layout entry) gives each pipeline stage's GPU bytes per phase
(`stage_phase_gb`, memory.phase_gpu_bytes); a `lockstep train` run logs each rank's peak per phase
(metrics/phase_memory.py: perf/memory/rankR/<phase>_peak_gb, or the plain names on one process).
Phases pair up as
    measured rollout      planned generate   (the engine's workspace over its weights and caches)
    measured train        planned train      (colocated; else the actor's activations or gradients,
                                              whichever is larger, or what is always held)
    measured weight_sync  planned push       (the staged update)
On a disaggregated plan the rollout GPUs are not a stage: only the train phase of the trainer
ranks is compared. Rank r holds stage r // (ranks / PP) (Megatron's order, pipeline outermost:
dist/pipeline_grid.py). A stage's measured figure is the largest over its ranks and the run's
steps. On a CPU the measured figure is the process's peak RSS (Python and libraries included), so
the error there says little; on a GPU it is torch.cuda.max_memory_allocated, the plan's unit.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "perf/memory/"  # metrics/phase_memory.py's names
PLANNED_PHASE = {"rollout": ("generate",), "train": ("train", "activations", "gradients"), "weight_sync": ("push",)}


@dataclass(frozen=True)
class StagePhase:
    stage: int
    phase: str  # the run's name: rollout, train, weight_sync
    ranks: tuple[int, ...]
    planned_gb: float
    measured_gb: float

    @property
    def error(self) -> float:
        """(planned - measured) / measured: > 0 the plan over-counts."""
        return (self.planned_gb - self.measured_gb) / self.measured_gb


def measured_peaks(lines: list[dict]) -> dict[int, dict[str, float]]:
    """{rank: {phase: GB}}, the largest over the metrics lines; a one-process run is rank 0."""
    out: dict[int, dict[str, float]] = {}
    for line in lines:
        for key, value in line.items():
            if not key.startswith(PREFIX) or not key.endswith("_peak_gb"):
                continue
            rest = key[len(PREFIX):-len("_peak_gb")]
            if "/" in rest:
                rank_part, phase = rest.split("/", 1)
                rank = int(rank_part.removeprefix("rank"))
            elif any(k.startswith(f"{PREFIX}rank") for k in line):
                continue  # the plain name is the largest over the ranks: each rank's is there
            else:
                rank, phase = 0, rest
            peaks = out.setdefault(rank, {})
            peaks[phase] = max(peaks.get(phase, 0.0), float(value))
    return out


def planned_phase(stage_phase_gb: dict[str, float], phase: str) -> float:
    """The plan's GB of a stage in the run's `phase` (module docstring)."""
    return max((stage_phase_gb[p] for p in PLANNED_PHASE[phase] if p in stage_phase_gb),
               default=stage_phase_gb["held"])


def compare(entry: dict, lines: list[dict]) -> list[StagePhase]:
    """Every (stage, phase) the plan entry and the run's metrics lines both have."""
    peaks = measured_peaks(lines)
    if not peaks:
        raise ValueError("the run's metrics have no perf/memory/ peaks (a run from before they were logged?)")
    stages = entry["stage_phase_gb"]
    ranks = max(peaks) + 1
    trainer_ranks = ranks if entry.get("colocate") else entry["dp"] * entry["pp"] * entry["tp"] * entry["cp"]
    per_stage = max(1, trainer_ranks // len(stages))
    phases = ("rollout", "train", "weight_sync") if entry.get("colocate") else ("train",)
    out = []
    for s, planned in enumerate(stages):
        members = tuple(r for r in range(s * per_stage, (s + 1) * per_stage) if r in peaks)
        for phase in phases:
            got = [peaks[r][phase] for r in members if phase in peaks[r]]
            if got:
                out.append(StagePhase(s, phase, members, planned_phase(planned, phase), max(got)))
    return out


def report(rows: list[StagePhase]) -> list[str]:
    return [f"stage {r.stage} (ranks {', '.join(map(str, r.ranks))}) {r.phase}: planned {r.planned_gb:.3f} GB, "
            f"measured {r.measured_gb:.3f} GB, plan error {100 * r.error:+.1f}%" for r in rows]
