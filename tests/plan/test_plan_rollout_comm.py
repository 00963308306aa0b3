"""Rollout memory, communication and compute terms against hand arithmetic."""

from dataclasses import replace

import pytest

from lockstep.plan.cluster import RolloutSpec, TrainSpec
from lockstep.plan.comm import step_comm
from lockstep.plan.compute import mean_min
from lockstep.plan.layout import PlanError, make_layout
from lockstep.plan.memory import stage_layer_indices
from lockstep.plan.model import DEEPSEEK_V4_FLASH
from lockstep.plan.params import all_groups, buffer_bytes
from lockstep.plan.planner import plan
from lockstep.plan.rollout import SERVE_BYTES, cache_bytes_per_seq, push_bytes_per_param, rollout_memory


def test_v4_cache_per_sequence_by_hand(tiny_v4):
    # S = 32, bf16, d = 32, indexer d = 8, window 8: window on all 4 layers, C4 entries + indexer keys +
    # fp32 kv/gate tail of 2*4 slots, C128 has no closed block yet but keeps a 128-token tail.
    window = 4 * 8 * 32 * 2
    c4 = 32 // 4 * (32 + 8) * 2 + 2 * 4 * (2 * 32 + 2 * 8) * 2 * 4
    c128 = 0 + 128 * 32 * 2 * 4
    assert cache_bytes_per_seq(tiny_v4, 32, "bf16") == window + c4 + c128 == 40_576
    flash = 43 * 128 * 512 * 2 + 21 * (1024 * 640 * 2 + 8 * 1280 * 8) + 20 * (32 * 512 * 2 + 128 * 512 * 8)
    assert cache_bytes_per_seq(DEEPSEEK_V4_FLASH, 4096, "bf16") == flash == 46_022_656


def test_llama_cache_and_rollout_terms(tiny_llama, small_cluster):
    assert cache_bytes_per_seq(tiny_llama, 32, "fp8") == 4 * 32 * 2 * 2 * 16 * 1
    ro = RolloutSpec(concurrency=10, gpus_per_engine=4, attention="tp")
    terms = {t.name: t.bytes for t in rollout_memory(tiny_llama, small_cluster, ro, 32).terms}
    assert terms["dense weights"] == 4 * (4096 * 3 + 24576) * 2 / 4 + 4 * 128 * 2 + 64 * 2
    assert terms["embedding + head"] == 2 * 1000 * 64 * 2 / 4
    assert terms["caches"] == 10 * (4 * 32 * 2 * 2 * 16 * 2) / 2  # KV heads (2) split over the engine
    # data-parallel attention (lockstep's EP engine): every rank keeps the whole vocabulary
    dp = {t.name: t.bytes for t in rollout_memory(tiny_llama, small_cluster, replace(ro, attention="dp"), 32).terms}
    assert dp["embedding + head"] == 2 * 1000 * 64 * 2


def test_push_staging_is_the_whole_push_and_not_beside_the_workspace(tiny_v4, small_cluster, small_train):
    """weight_push.py stages every bucket on every engine GPU until the commit vote, with the engine
    paused: the push's bytes are one term, and only the larger of it and the workspace counts."""
    lay = make_layout(tiny_v4, small_cluster, small_train, tp=1, pp=1, ep=1, cp=1)
    for fmt in ("bf16", "serving"):
        for chunk in (1, 1 << 20):  # the staging, then the workspace, is the larger
            ro = RolloutSpec(gpus_per_engine=4, push_format=fmt, chunk_tokens=chunk)
            rm = rollout_memory(tiny_v4, small_cluster, ro, 32)
            terms = {t.name: t.bytes for t in rm.terms}
            pushed = step_comm(tiny_v4, small_cluster, small_train, ro, lay, [range(4)])[-1]
            assert pushed.name == "weight push" and terms["weight push staging"] == pushed.bytes
            assert terms["weight push staging"] == sum(g.count * push_bytes_per_param(g, ro)
                                                       for g in all_groups(tiny_v4)) + buffer_bytes(tiny_v4)
            kept = sum(terms.values()) - terms["workspace"] - terms["weight push staging"]
            assert rm.gpu_bytes == kept + max(terms["workspace"], terms["weight push staging"])
            assert (terms["workspace"] > terms["weight push staging"]) == (chunk > 1)


def test_v4_flash_rollout_weights():
    from lockstep.plan.cluster import ClusterSpec
    c = ClusterSpec(nodes=4, gpus_per_node=8, gpu_memory_gb=288, actor_nodes=2, rollout_nodes=2)
    rm = rollout_memory(DEEPSEEK_V4_FLASH, c, RolloutSpec(), 4096)
    terms = {t.name: t.bytes for t in rm.terms}
    assert terms["routed experts"] == pytest.approx(277_025_390_592 * (0.5 + 1 / 32) / 8)
    assert terms["caches"] == 32 * 46_022_656  # 256 sequences / 8 GPUs with data-parallel attention
    assert rm.engines == 2
    assert SERVE_BYTES["fp4"] == 0.53125
    with pytest.raises(PlanError, match="rollout EP 3"):
        rollout_memory(DEEPSEEK_V4_FLASH, replace(c, gpus_per_node=3, rollout_nodes=1, actor_nodes=1),
                       RolloutSpec(gpus_per_engine=3), 4096)


def test_planned_weight_push_is_the_whole_model(v4_flash_cluster):
    # every layout pushes every parameter once (stages summed) plus the policy buffers
    train = TrainSpec(seq_len=4096, max_tokens_per_gpu=8192)
    pushed = {}
    for fmt in ("bf16", "serving"):
        ro = RolloutSpec(push_format=fmt)
        whole = sum(g.count * push_bytes_per_param(g, ro) for g in all_groups(DEEPSEEK_V4_FLASH))
        plans = plan(DEEPSEEK_V4_FLASH, v4_flash_cluster, train, ro)
        assert {p.comm_term("weight push").bytes for p in plans} == {whole + buffer_bytes(DEEPSEEK_V4_FLASH)}
        pushed[fmt] = whole
    assert pushed["serving"] < 0.3 * pushed["bf16"]


def test_comm_terms_by_hand(tiny_llama, small_cluster, small_train, rollout):
    lay = make_layout(tiny_llama, small_cluster, small_train, tp=2, pp=2, ep=1, cp=1)
    stages = stage_layer_indices(tiny_llama, lay, None)
    comm = {c.name: c for c in step_comm(tiny_llama, small_cluster, small_train, rollout, lay, stages)}
    mb, L, passes, t, H = 4, 2, 2, 64, 64
    # attention + MLP, each one all-reduce equivalent 2(TP-1)/TP of t*H*2 bytes.
    assert comm["TP all-reduce"].bytes == mb * L * 2 * passes * 2 * (1 / 2) * t * H * 2
    assert comm["TP all-reduce"].seconds == pytest.approx(comm["TP all-reduce"].bytes / 400e9)
    assert comm["PP send/recv"].bytes == mb * 2 * t * 1 * H * 2 / 2
    assert comm["EP all-to-all"].bytes == 0 and comm["DP gradient reduce"].bytes == 0
    assert comm["weight push"].bytes == 276_032 * 2


def test_dp_and_ep_terms(tiny_v4, small_cluster, small_train):
    ro = RolloutSpec(gpus_per_engine=4)
    train = replace(small_train, recompute=True)
    lay = make_layout(tiny_v4, small_cluster, train, tp=1, pp=1, ep=4, cp=1)  # DP 4, EDP 1
    stages = stage_layer_indices(tiny_v4, lay, None)
    comm = {c.name: c for c in step_comm(tiny_v4, small_cluster, train, ro, lay, stages)}
    mb = 1  # 256 tokens / (4 x 64)
    assert comm["EP all-to-all"].bytes == mb * 4 * 3 * 2 * 64 * 2 * 64 * 2 * 3 / 4
    dense = 182_643 - 4 * 8 * 3 * 64 * 16
    assert comm["DP gradient reduce"].bytes == pytest.approx(3 / 4 * dense * (4 + 2))


def test_mean_min():
    assert mean_min(float("inf"), 1.0, 4) == 2.5
    assert mean_min(10, 1.0, 10) == 5.5
    assert mean_min(2, 1.0, 100) == pytest.approx((2 + 2 * 98) / 100)
