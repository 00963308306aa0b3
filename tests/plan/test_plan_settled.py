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


def _terms(p):
    return {t.name: t.bytes for t in p.worst.terms}


def test_settled_layout_fits(v4_flash_cluster, flash_train, rollout):
    p = _settled(v4_flash_cluster, flash_train(), rollout)
    assert p.feasible and p.reason == ""
    assert [len(s.layers) for s in p.stages] == [11, 11, 11, 10]
    assert p.worst.stage == 0  # 11 layers, embedding, and 4 micro-batches in flight
    t = _terms(p)
    dense = t["weights"] / 2 - EXPERTS_PER_GPU
    assert dense == pytest.approx(2.116e9, rel=1e-3)  # 11 layers' attention/shared/mHC + embedding
    assert t["gradients"] == pytest.approx((dense + EXPERTS_PER_GPU) * 4)
    assert t["host: optimizer states"] == pytest.approx((dense / 4 + EXPERTS_PER_GPU / 1) * 12)
    assert t["activations (recompute: layer inputs)"] == 4 * 11 * 8192 * 4 * 4096 * 2
    assert 130 * GB < p.actor_bytes < 0.6 * p.usable_bytes
    assert p.rollout.gpu_bytes < 0.2 * p.usable_bytes


def test_without_offload_it_breaks_on_optimizer_states(v4_flash_cluster, flash_train, rollout):
    with_offload = _settled(v4_flash_cluster, flash_train(), rollout)
    p = _settled(v4_flash_cluster, flash_train(offload=False), rollout)
    assert not p.feasible
    assert "actor stage 0" in p.reason and "optimizer states" in p.reason
    optimizer = _terms(p)["optimizer states"]
    assert optimizer == pytest.approx(_terms(with_offload)["host: optimizer states"])
    assert p.actor_bytes == pytest.approx(with_offload.actor_bytes + optimizer)


def test_without_recompute_it_breaks_on_activations(v4_flash_cluster, flash_train, rollout):
    p = _settled(v4_flash_cluster, flash_train(recompute=False), rollout)
    assert not p.feasible and "activations" in p.reason
    assert _terms(p)["activations"] > 200 * GB  # 4 micro-batches x 11 layers x 8192 tokens x ~715 KB
    assert not _settled(v4_flash_cluster, flash_train(recompute=False, offload=False), rollout).feasible


def test_ranking_and_weight_push(v4_flash_cluster, flash_train, rollout):
    plans = plan(FLASH, v4_flash_cluster, flash_train(), rollout)
    feasible = [p for p in plans if p.feasible]
    assert feasible and plans[: len(feasible)] == feasible  # feasible first
    assert [p.step_seconds for p in feasible] == sorted(p.step_seconds for p in feasible)
    assert all(p.reason for p in plans[len(feasible):])
    assert any((p.layout.tp, p.layout.pp, p.layout.ep, p.layout.cp) == (1, 4, 4, 1) for p in feasible)
    push = _settled(v4_flash_cluster, flash_train(), rollout).comm_term("weight push")
    # bf16 weights (fp32 for mHC, sinks, position biases) + tid2eid and router bias buffers.
    assert 2 * 284_332_230_231 < push.bytes < 2 * 284_332_230_231 * 1.001
    assert 2 < push.seconds < 4  # four stage senders, ~142 GB each over a 50 GB/s NIC
