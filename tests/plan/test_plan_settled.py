"""The layout the seed system settled on for DeepSeek-V4-Flash on 2 actor nodes of 8 x 288 GB:
TP1 / PP4 / EP4 with full recompute, optimizer offload and a last stage of 10 layers."""

import pytest

from lockstep.plan.cluster import GB
from lockstep.plan.layout import make_layout
from lockstep.plan.model import DEEPSEEK_V4_FLASH as FLASH
from lockstep.plan.planner import evaluate, plan

EXPERTS_PER_GPU = 11 * 256 * 3 * 4096 * 2048 / 4  # 11 layers on stage 0, 64 of 256 experts


def _settled(cluster, train, rollout):
    lay = make_layout(FLASH, cluster, train, tp=1, pp=4, ep=4, cp=1)
    return evaluate(FLASH, cluster, train, rollout, lay)


def _terms(p, stage=0):
    return {t.name: t.bytes for t in p.stages[stage].terms}


def test_settled_layout_fits(v4_flash_cluster, flash_train, serving_rollout):
    p = _settled(v4_flash_cluster, flash_train(), serving_rollout)
    assert p.feasible and p.reason == ""
    assert [len(s.layers) for s in p.stages] == [11, 11, 11, 10]
    # the last stage's head (fp32 logits and their gradient, 129,280 x 8 B per token: 8.5 GB at 8,192
    # tokens, + 3.2 GB of the head weight's fp32 gradient) nearly makes up for its one layer fewer
    # and its single micro-batch in flight: stage 0, with 4 in flight, stays the worst by ~6 GB
    logits = _terms(p, 3)["logits"]
    assert 12 * GB < logits < 13 * GB and p.worst.stage == 0
    assert 0 < p.stages[0].gpu_bytes - p.stages[3].gpu_bytes < logits
    t = _terms(p)
    dense = t["weights"] / 2 - EXPERTS_PER_GPU
    assert dense == pytest.approx(2.116e9, rel=1e-3)  # 11 layers' attention/shared/mHC + embedding
    assert t["gradients"] == pytest.approx((dense + EXPERTS_PER_GPU) * 4)
    assert t["host: optimizer states"] == pytest.approx((dense / 4 + EXPERTS_PER_GPU / 1) * 12)
    assert t["activations (recompute: layer inputs)"] == 4 * 11 * 8192 * 4 * 4096 * 2
    assert 140 * GB < p.actor_bytes < 0.7 * p.usable_bytes
    # the engine GPU's peak is the push it stages (the serving format, every tensor), not the workspace
    staged = {t.name: t.bytes for t in p.rollout.terms}["weight push staging"]
    assert staged == p.comm_term("weight push").bytes
    assert p.rollout.gpu_bytes == pytest.approx(p.rollout.gpu_bytes - p.rollout.largest().bytes + staged)
    assert 0.5 * p.usable_bytes < p.rollout.gpu_bytes < 0.8 * p.usable_bytes


def test_bf16_push_does_not_fit_an_engine_gpu(v4_flash_cluster, flash_train, rollout):
    p = _settled(v4_flash_cluster, flash_train(), rollout)
    assert not p.feasible and "rollout" in p.reason and "weight push staging" in p.reason


def test_without_offload_it_breaks_on_optimizer_states(v4_flash_cluster, flash_train, serving_rollout):
    with_offload = _settled(v4_flash_cluster, flash_train(), serving_rollout)
    p = _settled(v4_flash_cluster, flash_train(offload=False), serving_rollout)
    assert not p.feasible
    assert "actor stage 0" in p.reason and "optimizer states" in p.reason
    optimizer = _terms(p)["optimizer states"]
    assert optimizer == pytest.approx(_terms(with_offload)["host: optimizer states"])
    assert p.stages[0].gpu_bytes == pytest.approx(with_offload.stages[0].gpu_bytes + optimizer)


def test_without_recompute_it_breaks_on_activations(v4_flash_cluster, flash_train, rollout):
    p = _settled(v4_flash_cluster, flash_train(recompute=False), rollout)
    assert not p.feasible and "activations" in p.reason
    assert _terms(p)["activations"] > 200 * GB  # 4 micro-batches x 11 layers x 8192 tokens x ~2.7 MB (materialised scores: 64 heads x 4,096+ keys x 6 B)
    assert not _settled(v4_flash_cluster, flash_train(recompute=False, offload=False), rollout).feasible


def test_ranking_and_weight_push(v4_flash_cluster, flash_train, rollout, serving_rollout):
    plans = plan(FLASH, v4_flash_cluster, flash_train(), serving_rollout)
    feasible = [p for p in plans if p.feasible]
    assert feasible and plans[: len(feasible)] == feasible  # feasible first
    assert [p.step_seconds for p in feasible] == sorted(p.step_seconds for p in feasible)
    assert all(p.reason for p in plans[len(feasible):])
    assert any((p.layout.tp, p.layout.pp, p.layout.ep, p.layout.cp) == (1, 4, 4, 1) for p in feasible)
    push = _settled(v4_flash_cluster, flash_train(), rollout).comm_term("weight push")
    # bf16 weights (fp32 for mHC, sinks, position biases) + tid2eid and router bias buffers.
    assert 2 * 284_332_230_231 < push.bytes < 2 * 284_332_230_231 * 1.001
    assert 2 < push.seconds < 4  # four stage senders, ~142 GB each over a 50 GB/s NIC
