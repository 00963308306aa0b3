"""Peak memory per phase of an RL step (rollout, train, weight sync, eval), for each process.

What `lockstep plan` predicts is a GPU's peak per phase (plan/memory.py: the actor's forward and
backward vs its gradients, the engine's generation vs its push); a run that records the same
phases can be set against it, stage by stage. Per device:
  cuda  torch.cuda.max_memory_allocated: the bytes torch's allocator handed out, the plan's unit;
        the peak counter is reset when a phase starts
  cpu   the process's peak resident set size (Linux VmHWM, reset through /proc/self/clear_refs):
        everything the process holds (Python, libraries, the allocator's free blocks), so an
        upper bound on what the tensors took
and nothing elsewhere (no such counter). A phase that runs several times in one step (none today)
keeps its largest peak.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

GB = 1e9
PREFIX = "perf/memory/"  # a measurement of the run, not of the policy: runs compare equal without it (perf/*)
_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


class PhaseMemory:
    """`with memory.phase("train"): ...`, then `metrics()` -> {"perf/memory/train_peak_gb": ...}."""

    def __init__(self, device):
        device = torch.device(device)
        self.device = device
        self.kind = "cuda" if device.type == "cuda" else ("rss" if device.type == "cpu" and _rss_resettable() else None)
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        self._reset()
        try:
            yield
        finally:
            peak = self._peak()
            if peak is not None:
                self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def metrics(self) -> dict[str, float]:
        """This step's peaks in GB, then forgotten (the next step records its own)."""
        out = {f"{PREFIX}{name}_peak_gb": peak / GB for name, peak in self.peaks.items()}
        self.peaks = {}
        return out

    def _reset(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "rss":
            _CLEAR_REFS.write_text("5")  # 5: reset the peak resident set size (proc(5))

    def _peak(self) -> int | None:
        if self.kind == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.kind == "rss":
            return peak_rss_bytes()
        return None


def peak_rss_bytes() -> int:
    """The process's peak resident set size since start or the last reset (Linux)."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text()).group(1)) * 1024


def _rss_resettable() -> bool:
    try:
        peak_rss_bytes()
        _CLEAR_REFS.write_text("5")
    except (OSError, AttributeError):  # not Linux, or /proc read-only: no per-phase peak
        return False
    return True


def per_rank(gathered: list[dict[str, float]]) -> dict[str, float]:
    """Every rank's memory metrics (rank r's under perf/memory/rankR/...) and, under the plain names,
    the largest over the ranks: the GPU a layout has to fit."""
    out: dict[str, float] = {}
    for rank, m in enumerate(gathered):
        for key, value in m.items():
            out[key.replace(PREFIX, f"{PREFIX}rank{rank}/", 1)] = value
            out[key] = max(out.get(key, 0.0), value)
    return out
