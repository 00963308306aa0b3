"""lockstep.dist.launch: the arguments handed to torch's launcher, and a real 2-process launch of a
colocated weight push through it (torch.distributed.run sets the env:// variables we join with)."""

import json
import subprocess
import sys
from pathlib import Path

from dist_world import free_port
from lockstep.dist.config import DistConfig
from lockstep.dist.launch import should_launch, strip_launch_flags, torchrun_args
from processes import cli_env

HERE = Path(__file__).parent


def test_torchrun_args_and_flag_stripping(monkeypatch):
    cfg = DistConfig(nproc_per_node=2, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234)
    assert torchrun_args(cfg, ["-m", "lockstep.cli", "train"]) == [
        "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
        "--master-port", "1234", "-m", "lockstep.cli", "train"]
    argv = ["--nproc-per-node", "2", "--num-rollout", "3", "--master-port=99", "--use-tis", "--nnodes", "1"]
    assert strip_launch_flags(argv) == ["--num-rollout", "3", "--use-tis"]
    monkeypatch.delenv("RANK", raising=False)
    assert should_launch(cfg) and not should_launch(DistConfig())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "x")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert not should_launch(cfg)  # a started process never launches again


def test_launch_runs_a_colocated_push_on_two_processes(tmp_path):
    code = ("import sys; from lockstep.dist.config import DistConfig; from lockstep.dist.launch import launch; "
            f"launch(DistConfig(nproc_per_node=2, master_port={free_port()}), "
            f"[{str(HERE / 'torchrun_colocated_push.py')!r}, {str(tmp_path)!r}])")
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(seen):
        assert (s["rank"], s["world_size"], s["local_rank"], s["env_rank"]) == (r, 2, r, str(r))
        assert s["colocated"] and s["version"] == 1 and s["differs"] == [], s
        assert s["bytes"] > 2_000_000
