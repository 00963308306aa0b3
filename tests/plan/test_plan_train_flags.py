"""`lockstep plan --json` carries the `lockstep train` flags of each layout, parsed by train's own parser."""

import json

import pytest

from lockstep.cli import build_parser, main
from lockstep.commands.train import configs_from_args
from lockstep.dist.config import DistConfig
from lockstep.cli_args import dataclass_from_args
from lockstep.plan.cluster import ClusterSpec, TrainSpec
from lockstep.plan.layout import Layout
from lockstep.plan.train_flags import train_flags

CLUSTER = ClusterSpec(nodes=2, gpus_per_node=8, gpu_memory_gb=80, actor_nodes=1, rollout_nodes=1)


def _parse(flags):
    args = build_parser(["train"]).parse_args(["train", *flags])
    return dataclass_from_args(DistConfig, args), configs_from_args(args)[1]


def test_plan_json_flags_parse_with_train_parser(capsys):
    argv = ["plan", "--model", "deepseek-v4-flash", "--nodes", "4", "--json", "--tp", "1", "--pp", "1",
            "--cp", "1", "--ep", "16", "--recompute", "--max-tokens-per-gpu", "4096"]
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["not_runnable"] == "" and row["train_flags"]
    dist, train = _parse(row["train_flags"])
    assert dist.world_size == 32 and dist.actor_num_gpus == 16 and dist.rollout_num_gpus == 16
    assert train.expert_model_parallel_size == row["ep"] == 16
    assert train.pipeline_model_parallel_size == row["pp"] == 1
    assert train.recompute_activations and not train.optimizer_offload
    assert train.max_tokens_per_gpu == 4096


def test_offload_flags_parse():
    flags, why = train_flags(Layout(tp=1, pp=1, ep=1, cp=1, dp=8), CLUSTER, TrainSpec(seq_len=4096, max_tokens_per_gpu=8192, optimizer_offload=True))
    assert why == ""
    dist, train = _parse(flags)
    assert train.optimizer_offload and train.expert_model_parallel_size == 1
    assert (dist.nnodes, dist.nproc_per_node, dist.actor_num_gpus, dist.rollout_num_gpus) == (2, 8, 8, 8)


def test_tp_cp_pp_not_runnable():
    train = TrainSpec(seq_len=4096, max_tokens_per_gpu=8192)
    flags, why = train_flags(Layout(tp=2, pp=1, ep=1, cp=1, dp=4), CLUSTER, train)
    assert flags is None and "TP 2" in why
    assert "CP 2" in train_flags(Layout(tp=1, pp=1, ep=1, cp=2, dp=4), CLUSTER, train)[1]
    assert "PP 2" in train_flags(Layout(tp=1, pp=2, ep=1, cp=1, dp=4), CLUSTER, train)[1]
    assert "EP 4" in train_flags(Layout(tp=1, pp=1, ep=4, cp=1, dp=8), CLUSTER, train)[1]


COLOCATED = ClusterSpec(nodes=1, gpus_per_node=8, gpu_memory_gb=80, actor_nodes=1, rollout_nodes=1, colocate=True)


def test_colocated_pipeline_flags_parse_as_the_issue_19_layout():
    """PP 4 x EP 2 on 8 colocated GPUs with recompute and optimizer offload, one expert-parallel engine
    over them: lockstep's default world."""
    train = TrainSpec(seq_len=4096, max_tokens_per_gpu=8192, recompute=True, optimizer_offload=True)
    flags, why = train_flags(Layout(tp=1, pp=4, ep=2, cp=1, dp=2), COLOCATED, train, engine_gpus=8,
                             last_stage_layers=5)
    assert why == ""
    dist, parsed = _parse(flags)
    assert (dist.nnodes, dist.nproc_per_node, dist.actor_num_gpus, dist.rollout_num_gpus) == (1, 8, None, None)
    assert dist.rollout_expert_parallel_size == 8 and parsed.recompute_activations and parsed.optimizer_offload
    assert (parsed.pipeline_model_parallel_size, parsed.expert_model_parallel_size,
            parsed.decoder_last_pipeline_num_layers) == (4, 2, 5)


def test_colocated_layouts_lockstep_cannot_run_say_why():
    train = TrainSpec(seq_len=4096, max_tokens_per_gpu=8192)
    assert "PP 2 x EP 2 != the 8 ranks" in train_flags(Layout(tp=1, pp=2, ep=2, cp=1, dp=4), COLOCATED, train)[1]
    assert "EP 4 < the 8 ranks" in train_flags(Layout(tp=1, pp=1, ep=4, cp=1, dp=8), COLOCATED, train)[1]
    assert "engines of 4 GPUs" in train_flags(Layout(tp=1, pp=1, ep=1, cp=1, dp=8), COLOCATED, train,
                                              engine_gpus=4)[1]
    offload = TrainSpec(seq_len=4096, max_tokens_per_gpu=8192, optimizer_offload=True)
    for ep in (1, 8):  # FSDP over all 8, or EP over all 8: both offload
        flags, why = train_flags(Layout(tp=1, pp=1, ep=ep, cp=1, dp=8), COLOCATED, offload)
        assert why == "" and _parse(flags)[1].optimizer_offload


# ---- lockstep train --layout FILE: the plan's JSON read back --------------------------------------

# one layout per plan (every dimension fixed) on 16 nodes; what fits is set by the GPU memory given, far
# from any estimate's edge, so these tests do not move with the memory model
PLAN = ["plan", "--model", "deepseek-v4-flash", "--nodes", "16", "--json", "--recompute", "--max-tokens-per-gpu", "4096"]
RUNNABLE = ["--tp", "1", "--pp", "1", "--cp", "1", "--ep", "64"]
TP2 = ["--tp", "2", "--pp", "1", "--cp", "1", "--ep", "32"]
FITS, NOTHING_FITS = ["--gpu-memory-gb", "100000"], ["--gpu-memory-gb", "1"]


def _row(capsys, *flags) -> dict:
    assert main([*PLAN, *flags]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    return row


def _plan_file(tmp_path, rows: list) -> object:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(rows, indent=2))
    return path


def _configs(argv):
    """(DistConfig, RunConfig without its layout field, TrainConfig, EngineConfig) as `lockstep train` builds them."""
    import dataclasses

    from lockstep.commands.train import apply_layout

    args = build_parser(["train"]).parse_args(["train", *argv])
    apply_layout(args)
    run, train, engine = configs_from_args(args)
    return dataclass_from_args(DistConfig, args), dataclasses.replace(run, layout=""), train, engine


def test_layout_file_gives_the_config_of_the_printed_flags(tmp_path, capsys):
    row = _row(capsys, *RUNNABLE, *FITS)
    assert row["feasible"] and row["train_flags"]
    path = _plan_file(tmp_path, [row])
    assert _configs(["--layout", str(path)]) == _configs(row["train_flags"])
    dist, run, train, _ = _configs(["--layout", str(path), "--num-rollout", "3", "--max-tokens-per-gpu", "4096"])
    assert (dist.world_size, dist.actor_num_gpus, train.expert_model_parallel_size) == (128, 64, 64)
    assert run.num_rollout == 3 and train.recompute_activations  # flags the layout does not set, and one it does
    assert _configs(["--layout", str(path)]) != _configs([])  # the layout changed something


def test_layout_file_takes_the_best_layout_lockstep_can_run(tmp_path, capsys):
    """Ranked: a layout that does not fit, one that fits but lockstep cannot run (TP 2), then a runnable
    one: train takes #3, and the line it prints names #2's reason (#1 is passed over silently)."""
    from lockstep.commands.train import apply_layout

    rows = [_row(capsys, *RUNNABLE, *NOTHING_FITS), _row(capsys, *TP2, *FITS), _row(capsys, *RUNNABLE, *FITS)]
    assert [r["feasible"] for r in rows] == [False, True, True] and rows[0]["train_flags"] and not rows[1]["train_flags"]
    path = _plan_file(tmp_path, rows)
    args = build_parser(["train"]).parse_args(["train", "--layout", str(path)])
    note = apply_layout(args)
    assert note == (f"--layout {path}: layout #3 (tp1 pp1 ep64 cp1): {' '.join(rows[2]['train_flags'])} "
                    f"(passed over: #2 (tp2 pp1 ep32 cp1) not runnable: {rows[1]['not_runnable']})")
    assert _configs(["--layout", str(path)]) == _configs(rows[2]["train_flags"])


def _fails(argv, capsys) -> str:
    """`lockstep train ARGV` exits 2 with one error line (before any process starts); the line."""
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_layout_not_runnable_is_refused_with_its_reason(tmp_path, capsys):
    row = _row(capsys, *TP2, *FITS)
    assert row["feasible"] and row["train_flags"] is None and "TP 2" in row["not_runnable"]
    path = _plan_file(tmp_path, [row])
    err = _fails(["--layout", str(path), "--run-dir", str(tmp_path / "run")], capsys)
    assert f"{path}: lockstep train cannot run any layout that fits: #1 (tp2 pp1 ep32 cp1) not runnable: " \
           f"{row['not_runnable']}" in err
    assert not (tmp_path / "run").exists()


def test_layout_flag_given_twice_must_agree(tmp_path, capsys):
    path = _plan_file(tmp_path, [_row(capsys, *RUNNABLE, *FITS)])
    err = _fails(["--layout", str(path), "--max-tokens-per-gpu", "1024"], capsys)
    assert f"--max-tokens-per-gpu 1024 conflicts with --layout {path}, whose layout #1 sets --max-tokens-per-gpu 4096" \
        in err


def test_malformed_layout_files_name_file_and_field(tmp_path, capsys):
    from lockstep.plan.train_flags import chosen_layout

    path = tmp_path / "plan.json"
    path.write_text('[{"feasible": true,')
    assert f"{path}: line 1 column 20: invalid JSON" in _fails(["--layout", str(path)], capsys)
    path.write_text(json.dumps([{"tp": 1, "feasible": True, "not_runnable": ""}]))
    assert f"{path}: layout #1: missing field 'train_flags'" in _fails(["--layout", str(path)], capsys)
    path.write_text(json.dumps([{"feasible": True, "train_flags": "--nnodes 2", "not_runnable": ""}]))
    assert f"{path}: layout #1: field 'train_flags': unexpected value '--nnodes 2'" in _fails(["--layout", str(path)], capsys)
    path.write_text(json.dumps([{"feasible": True, "train_flags": ["--no-such-flag"], "not_runnable": ""}]))
    assert f"{path}: layout #1: field 'train_flags': lockstep train has no --no-such-flag" in \
        _fails(["--layout", str(path)], capsys)
    path.write_text(json.dumps({"feasible": True}))
    assert f"{path}: expected the non-empty JSON list" in _fails(["--layout", str(path)], capsys)
    path.write_text(json.dumps([{"feasible": False, "train_flags": None, "not_runnable": "", "reason": "OOM"}]))
    with pytest.raises(ValueError, match="no layout fits .*OOM"):
        chosen_layout(path)
