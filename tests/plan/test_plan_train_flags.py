"""`lockstep plan --json` carries the `lockstep train` flags of each layout, parsed by train's own parser."""

import json

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
