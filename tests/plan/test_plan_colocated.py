"""`lockstep plan --colocate`: every GPU holds its actor stage and its engine (planner.colocated_stage);
the train step's transient terms and the engine's never peak together."""

from dataclasses import replace

import pytest

from lockstep.plan.cluster import ClusterSpec, RolloutSpec, TrainSpec
from lockstep.plan.layout import make_layout
from lockstep.plan.memory import peak_gpu_bytes
from lockstep.plan.planner import evaluate

COLOCATED = ClusterSpec(nodes=1, gpus_per_node=4, gpu_memory_gb=1.0, actor_nodes=1, rollout_nodes=1, colocate=True)
ROLLOUT = RolloutSpec(concurrency=16, gpus_per_engine=1, chunk_tokens=256)


def _plan(model, cluster, train, pp=2):
    return evaluate(model, cluster, train, ROLLOUT, make_layout(model, cluster, train, tp=1, pp=pp, ep=1, cp=1))


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_a_colocated_gpu_holds_its_stage_and_its_engine_and_peaks_once(tiny_v4, micro_batches):
    train = TrainSpec(seq_len=64, max_tokens_per_gpu=64 * 16 // micro_batches, rollout_batch_size=4,
                      n_samples_per_prompt=4)  # 16 sequences of 64 tokens over DP 2
    apart = _plan(tiny_v4, replace(COLOCATED, colocate=False, nodes=2, rollout_nodes=1), train)
    together = _plan(tiny_v4, COLOCATED, train)
    engine = together.rollout
    for alone, both in zip(apart.stages, together.stages):
        names = [t.name for t in both.terms]
        assert names == [t.name for t in alone.terms] + [f"engine: {t.name}" for t in engine.terms]
        state = sum(t.bytes for t in alone.terms if t.name in ("weights", "optimizer states"))
        train_step = sum(t.bytes for t in alone.terms if t.name not in ("weights", "optimizer states"))
        if micro_batches == 1:  # gradients vs activations: the larger of the two (memory.py)
            train_step = max(sum(t.bytes for t in alone.terms if t.name == "gradients"),
                             sum(t.bytes for t in alone.terms if t.phase == "activations"))
        held = sum(t.bytes for t in engine.terms if not t.phase)  # the engine's weights and caches
        largest = max(train_step, *(t.bytes for t in engine.terms if t.phase))
        assert both.gpu_bytes == pytest.approx(state + held + largest)
        assert both.gpu_bytes < alone.gpu_bytes + peak_gpu_bytes(engine.terms)  # the phases do not add up
    assert together.actor_bytes > apart.actor_bytes


def test_colocated_gpus_that_overflow_name_the_stage_not_a_rollout_gpu(tiny_v4):
    train = TrainSpec(seq_len=64, max_tokens_per_gpu=1024, rollout_batch_size=4, n_samples_per_prompt=4)
    tight = replace(COLOCATED, gpu_memory_gb=0.01)
    p = _plan(tiny_v4, tight, train)
    assert not p.feasible and p.reason.startswith("actor stage") and "rollout:" not in p.reason


def test_colocate_needs_every_node_on_both_sides():
    with pytest.raises(ValueError, match="must both be the 2 nodes"):
        ClusterSpec(nodes=2, gpus_per_node=4, gpu_memory_gb=1.0, actor_nodes=1, rollout_nodes=1, colocate=True)
