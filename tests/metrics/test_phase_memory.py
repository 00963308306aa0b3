"""metrics/phase_memory.py: each phase's peak memory (the process's peak RSS on a Linux CPU)."""

import pytest
import torch

from lockstep.metrics.phase_memory import PhaseMemory, per_rank

# the CPU measurement is Linux's resettable peak RSS (/proc/self/clear_refs); CI runs Linux
needs_peak_rss = pytest.mark.skipif(PhaseMemory("cpu").kind is None, reason="no resettable peak RSS (not Linux)")


@needs_peak_rss
def test_each_phase_reports_its_own_peak_and_a_step_forgets_the_last():
    memory = PhaseMemory("cpu")
    with memory.phase("rollout"):
        big = torch.ones(300_000_000 // 4)  # 300 MB, touched
        big.add_(1)
    del big
    with memory.phase("train"):  # the counter starts again: the rollout's 300 MB is not this phase's
        small = torch.ones(1000)
        small.add_(1)
    m = memory.metrics()
    assert set(m) == {"perf/memory/rollout_peak_gb", "perf/memory/train_peak_gb"}
    assert m["perf/memory/rollout_peak_gb"] - m["perf/memory/train_peak_gb"] > 0.25
    assert memory.metrics() == {}  # the next step records its own


@needs_peak_rss
def test_a_phase_that_raises_still_records_its_peak():
    memory = PhaseMemory("cpu")
    with pytest.raises(RuntimeError):
        with memory.phase("train"):
            raise RuntimeError("boom")
    assert "perf/memory/train_peak_gb" in memory.metrics()


def test_per_rank_keeps_every_rank_and_the_largest_under_the_plain_name():
    got = per_rank([{"perf/memory/train_peak_gb": 1.5, "perf/memory/rollout_peak_gb": 2.0},
                    {"perf/memory/train_peak_gb": 3.0, "perf/memory/rollout_peak_gb": 0.5}])
    assert got == {"perf/memory/rank0/train_peak_gb": 1.5, "perf/memory/rank0/rollout_peak_gb": 2.0,
                   "perf/memory/rank1/train_peak_gb": 3.0, "perf/memory/rank1/rollout_peak_gb": 0.5,
                   "perf/memory/train_peak_gb": 3.0, "perf/memory/rollout_peak_gb": 2.0}
