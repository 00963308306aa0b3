"""plan/measured.py: a plan entry's per-stage phases against a run's per-rank peaks."""

import pytest

from lockstep.plan.measured import compare, measured_peaks

STAGES = [{"held": 10.0, "train": 30.0, "generate": 14.0, "push": 12.0},
          {"held": 8.0, "train": 20.0, "generate": 12.0, "push": 11.0}]


def _line(step, **peaks):
    return {"step": step, **{f"perf/memory/{k.replace('__', '/')}_peak_gb": v for k, v in peaks.items()}}


def test_each_rank_largest_over_the_steps_and_the_plain_names_left_when_ranks_are_there():
    lines = [_line(1, rank0__train=1.0, rank1__train=2.0, train=2.0), _line(2, rank0__train=1.5, rank1__train=0.5,
                                                                          train=1.5), {"step": 0, "eval/x": 1.0}]
    assert measured_peaks(lines) == {0: {"train": 1.5}, 1: {"train": 2.0}}
    assert measured_peaks([_line(1, train=3.0, rollout=4.0)]) == {0: {"train": 3.0, "rollout": 4.0}}


def test_colocated_pipeline_stages_take_their_ranks_in_megatron_order():
    # PP 2 x EP 2 on 4 ranks: stage 0 on ranks 0 and 1, stage 1 on ranks 2 and 3
    entry = {"colocate": True, "tp": 1, "pp": 2, "ep": 2, "cp": 1, "dp": 2, "stage_phase_gb": STAGES}
    lines = [_line(1, **{f"rank{r}__{p}": 10.0 * (r + 1) + i for r in range(4)
                         for i, p in enumerate(("rollout", "train", "weight_sync"))})]
    rows = compare(entry, lines)
    assert [(r.stage, r.phase, r.ranks) for r in rows] == [
        (s, p, (2 * s, 2 * s + 1)) for s in (0, 1) for p in ("rollout", "train", "weight_sync")]
    train0 = next(r for r in rows if (r.stage, r.phase) == (0, "train"))
    assert (train0.planned_gb, train0.measured_gb) == (30.0, 21.0)  # the larger of ranks 0 and 1
    assert train0.error == pytest.approx((30 - 21) / 21)
    push1 = next(r for r in rows if (r.stage, r.phase) == (1, "weight_sync"))
    assert (push1.planned_gb, push1.measured_gb) == (11.0, 42.0)


def test_disaggregated_plans_compare_the_trainer_ranks_train_phase_only():
    # 2 trainer ranks (PP 2), then 2 engine ranks: the engines are no stage
    entry = {"tp": 1, "pp": 2, "ep": 1, "cp": 1, "dp": 1,
             "stage_phase_gb": [{"held": 5.0, "activations": 9.0, "gradients": 7.0}, {"held": 4.0}]}
    lines = [_line(1, **{f"rank{r}__{p}": 1.0 + r for r in range(4) for p in ("rollout", "train")})]
    rows = compare(entry, lines)
    assert [(r.stage, r.phase, r.ranks, r.planned_gb, r.measured_gb) for r in rows] == [
        (0, "train", (0,), 9.0, 1.0), (1, "train", (1,), 4.0, 2.0)]


def test_a_run_without_memory_metrics_says_so():
    with pytest.raises(ValueError, match="no perf/memory/ peaks"):
        compare({"stage_phase_gb": STAGES}, [{"step": 1, "train/loss": 0.1}])
