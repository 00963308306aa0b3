"""Layout validation, pipeline stages, enumeration and rank placement."""

from dataclasses import replace

import pytest

from lockstep.plan.cluster import ClusterSpec, TrainSpec
from lockstep.plan.layout import (PlanError, enumerate_layouts, group_ranks, make_layout, peers,
                                  pp_crosses_nodes, stage_layers)
from lockstep.plan.model import DEEPSEEK_V4_FLASH


def test_stage_layers():
    assert stage_layers(43, 4, 10) == (11, 11, 11, 10)
    assert stage_layers(43, 2, 10) == (33, 10)
    assert stage_layers(43, 1, 10) == (43,)
    assert stage_layers(48, 4, None) == (12, 12, 12, 12)
    # no last stage given: the most even split whose last stage is the lightest (Megatron's flag, chosen)
    assert stage_layers(43, 4, None) == (11, 11, 11, 10)
    assert stage_layers(43, 2, None) == (22, 21)
    assert stage_layers(43, 6, None) == (8, 8, 8, 8, 8, 3)
    with pytest.raises(PlanError, match="43 layers do not split over PP 16 .* --decoder-last-pipeline-num-layers"):
        stage_layers(43, 16, None)
    with pytest.raises(PlanError, match="33 layers are not divisible over PP - 1 = 4"):
        stage_layers(43, 5, 10)
    with pytest.raises(PlanError, match="must be smaller"):
        stage_layers(43, 4, 43)


def test_bad_layouts_give_clear_errors(v4_flash_cluster, flash_train, tiny_llama, small_cluster, small_train):
    m, c, t = DEEPSEEK_V4_FLASH, v4_flash_cluster, flash_train()
    cases = [
        (dict(tp=1, pp=4, ep=512, cp=1), "EP 512 is larger than the 256 routed experts"),
        (dict(tp=1, pp=4, ep=3, cp=1), "TP\\*PP\\*CP|EP 3 does not divide"),
        (dict(tp=1, pp=4, ep=8, cp=1), "EP 8 does not divide TP\\*CP\\*DP = 4"),
        (dict(tp=16, pp=1, ep=1, cp=1), "TP 16 spans nodes \\(--gpus-per-node 8\\)"),
        (dict(tp=1, pp=12, ep=1, cp=1), "does not divide the 16 actor GPUs \\(--actor-nodes 2 x --gpus-per-node 8\\)"),
        (dict(tp=1, pp=8, ep=1, cp=1), "not divisible over PP - 1 = 7"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(PlanError, match=msg):
            make_layout(m, c, t, **kwargs)
    assert make_layout(m, c, replace(t, decoder_last_pipeline_num_layers=None), tp=1, pp=2, ep=1, cp=1).pp == 2
    with pytest.raises(PlanError, match="is dense"):
        make_layout(tiny_llama, small_cluster, small_train, tp=1, pp=1, ep=2, cp=1)
    with pytest.raises(PlanError, match="does not fit a micro-batch"):
        make_layout(m, c, replace(t, seq_len=32768), tp=1, pp=4, ep=4, cp=2)
    # Fixing all four dimensions surfaces the error instead of returning an empty list.
    with pytest.raises(PlanError, match="larger than the 256"):
        enumerate_layouts(m, c, t, tp=1, pp=4, ep=512, cp=1)


def test_enumeration_for_v4_flash(v4_flash_cluster, flash_train):
    layouts = enumerate_layouts(DEEPSEEK_V4_FLASH, v4_flash_cluster, flash_train())
    # 43 layers with a last stage of 10: PP - 1 must divide 33 and PP must divide 16 GPUs.
    assert {lay.pp for lay in layouts} == {1, 2, 4}
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}
    assert {lay.cp for lay in layouts} == {1, 2, 4}
    assert max(lay.ep for lay in layouts) == 16
    assert all(lay.stage_gpus % lay.ep == 0 and lay.tp * lay.pp * lay.cp * lay.dp == 16 for lay in layouts)
    settled = [lay for lay in layouts if (lay.tp, lay.pp, lay.ep, lay.cp) == (1, 4, 4, 1)]
    assert len(settled) == 1 and settled[0].dp == 4 and settled[0].edp == 1
    fixed = enumerate_layouts(DEEPSEEK_V4_FLASH, v4_flash_cluster, flash_train(), pp=4, cp=1)
    assert {(lay.tp, lay.ep) for lay in fixed} == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1),
                                                   (4, 2), (4, 4)}


def test_rank_placement():
    c = ClusterSpec(nodes=4, gpus_per_node=8, gpu_memory_gb=80, actor_nodes=2, rollout_nodes=2)
    t = TrainSpec(seq_len=4096, max_tokens_per_gpu=8192, decoder_last_pipeline_num_layers=10)
    lay = make_layout(DEEPSEEK_V4_FLASH, c, t, tp=1, pp=4, ep=4, cp=1)
    assert group_ranks(lay, "ep") == [0, 1, 2, 3] and peers(group_ranks(lay, "ep"), 8) == (3, 0)
    assert group_ranks(lay, "dp") == [0, 1, 2, 3]
    assert pp_crosses_nodes(lay, 8)  # stages of 4 GPUs: stage 1 -> 2 goes from node 0 to node 1
    wide = make_layout(DEEPSEEK_V4_FLASH, c, t, tp=1, pp=1, ep=16, cp=1)
    assert peers(group_ranks(wide, "ep"), 8) == (7, 8)
    tp2 = make_layout(DEEPSEEK_V4_FLASH, c, t, tp=2, pp=1, ep=4, cp=2)
    assert group_ranks(tp2, "cp") == [0, 2] and group_ranks(tp2, "dpcp") == [0, 2, 4, 6, 8, 10, 12, 14]


def test_partly_fixed_search_says_why_nothing_is_valid(v4_flash_cluster, flash_train):
    """A fixed dimension that rules out every layout is named, with the flag to change
    (was: "no valid layout ... fix all of --tp --pp --ep --cp to see why one fails")."""
    with pytest.raises(PlanError, match=r"none of the 240 layouts searched is valid: TP 16 spans nodes "
                                        r"\(--gpus-per-node 8\) \(240 layouts\)"):
        enumerate_layouts(DEEPSEEK_V4_FLASH, v4_flash_cluster, flash_train(), tp=16)
    with pytest.raises(PlanError, match="PP - 1 = 7 stages \\(--decoder-last-pipeline-num-layers 10\\)"):
        enumerate_layouts(DEEPSEEK_V4_FLASH, v4_flash_cluster, flash_train(), pp=8)
