"""`lockstep train --ray-address HOST:PORT` (lockstep/dist/ray_launch.py) on a real local Ray head.

The head is `ray start --head --block` on 2 CPUs and no GPU, in a temp dir of its own (other Ray
sessions on the machine are left alone), stopped by SIGTERM to that one process at the end of the
module. On it:

- the 2-rollout colocated run of tests/dist/test_train_world.py (`--batch-invariant
  --max-tokens-per-gpu 172`, its helpers) on 2 Ray actors logs bitwise the metrics.jsonl of the same
  run on 2 torchrun processes (perf/* aside): the actors run the per-rank code torchrun's processes run;
- a rank's actor killed (as soon as it exists: the same path as mid-run, without waiting for a
  rollout) ends the driver with an error naming that rank within moments, not the timeout;
- GPU bundles on a CPU-only cluster end the driver after --distributed-timeout, naming what it lacks.
Without the head: an address where nothing listens and a missing `ray` package each fail at once with
what to do, and the rank order / environment are checked on made-up placements of two nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from dist_world import free_port
from lockstep.dist.groups import Layout
from lockstep.dist.ray_launch import (INSTALL_HINT, Place, RayLaunchError, forwarded_env, import_ray, rank_env,
                                      rank_order, role)
from processes import cli_env
from test_train_world import SIZES, _first_difference, _perf_free, _train


def _env() -> dict[str, str]:
    env = cli_env()
    env.pop("RAY_ADDRESS", None)
    return env


def _wait_for_port(port: int, head: subprocess.Popen, log, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            log.seek(0)
            raise AssertionError(f"ray start exited with {head.returncode}: {log.read()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the Ray head did not listen on {port} within {timeout_s}s")


@pytest.fixture(scope="module")
def ray_head():
    """HOST:PORT of a fresh local Ray head (module docstring); stopped when the module is done."""
    import_ray()  # without the extra: its install line (.ci/run installs it)
    port, temp = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a limit
    # the `ray` command of this interpreter's Ray
    log = open(os.path.join(temp, "head.log"), "w+")  # a file, not a pipe nobody drains
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             "--port", str(port), "--num-cpus", "2", "--num-gpus", "0", "--include-dashboard=false",
                             "--disable-usage-stats", "--temp-dir", temp], env=_env(), stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_port(port, head, log, 60)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=40)
        except subprocess.TimeoutExpired:
            head.kill()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_rank_order_environment_and_names():
    places = [Place(0, "10.0.0.10", (1,)), Place(1, "10.0.0.9", (3,)), Place(2, "10.0.0.10", (0,)),
              Place(3, "10.0.0.9", (2,))]
    ordered = rank_order(places)
    assert [p.bundle for p in ordered] == [3, 1, 2, 0]  # 10.0.0.9 before 10.0.0.10, as addresses
    cpu = rank_env(2, ordered, "10.0.0.9", 1234, gpu=False)
    assert cpu == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1234"}
    assert rank_env(3, ordered, "10.0.0.9", 1234, gpu=False)["LOCAL_RANK"] == "1"
    # a GPU actor sees only its own GPU: one local rank on one device (cuda:0, NCCL)
    gpu = rank_env(3, ordered, "10.0.0.9", 1234, gpu=True)
    assert (gpu["RANK"], gpu["LOCAL_RANK"], gpu["LOCAL_WORLD_SIZE"]) == ("3", "0", "1")
    # the driver's torch / NCCL / gloo / lockstep settings reach the actors; the rest is the node's own
    assert forwarded_env({"NCCL_CUMEM_ENABLE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "PATH": "/x",
                          "CUDA_VISIBLE_DEVICES": "0,1", "TORCHELASTIC_RUN_ID": "x", "LOCKSTEP_TRACEBACK": "1"}) == {
        "NCCL_CUMEM_ENABLE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "LOCKSTEP_TRACEBACK": "1"}
    # actor names say what the layout makes of each rank
    assert [role(Layout.disaggregated(1, 2), r) for r in range(3)] == ["trainer", "rollout", "rollout"]
    assert role(Layout.colocated(2), 1) == "colocated"


def test_missing_ray_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayLaunchError, match="not installed: " + INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
        import_ray()
    from lockstep.cli import main

    assert main(["train", *SIZES, "--ray-address", "auto", "--nproc-per-node", "2"]) == 1
    assert INSTALL_HINT in capsys.readouterr().err


def test_an_address_where_no_head_answers_fails_at_once(capsys):
    from lockstep.cli import main

    start, port = time.monotonic(), free_port()  # nothing listens there (ray.init would retry for minutes)
    assert main(["train", *SIZES, "--ray-address", f"127.0.0.1:{port}", "--nproc-per-node", "2"]) == 1
    assert f"--ray-address 127.0.0.1:{port}: no Ray head answers there (" in capsys.readouterr().err
    assert time.monotonic() - start < 15


def test_ray_actors_log_the_metrics_of_torchrun_processes(tmp_path, ray_head, two_processes):
    # the torchrun run: test_train_world.py's 2-process run (tests/dist/conftest.py, run once a session)
    on_ray = _train(tmp_path / "ray", "--ray-address", ray_head, "--nproc-per-node", "2")
    torchrun = two_processes
    assert json.loads((tmp_path / "ray" / "config.json").read_text())["world_size"] == 2
    assert len(on_ray) == len(torchrun) == 3  # step 0's eval, then 2 rollouts
    assert [line["train/num_microbatches"] for line in on_ray if "train/step" in line] == [2.0] * 2
    assert _first_difference(torchrun, on_ray) is None, _first_difference(torchrun, on_ray)
    assert [_perf_free(line) for line in on_ray] == [_perf_free(line) for line in torchrun]


# polls the cluster's named actors (Ray's own registry) until rank 1's is there, then kills it (SIGKILL)
KILL_RANK1 = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == "lockstep-rank1-colocated"]
    if named:
        ray.kill(ray.get_actor(named[0]["name"], namespace=named[0]["namespace"]))
        sys.exit(0)
    time.sleep(0.1)
sys.exit("rank 1's actor never appeared")
"""


def test_a_killed_rank_ends_the_driver_naming_it(tmp_path, ray_head):
    # killed as soon as it exists: rank 0 then waits in the rendezvous for a peer that never comes, which
    # would take the whole 60 s timeout; the driver sees the dead actor and stops rank 0 instead
    driver = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "train", *SIZES, "--run-dir",
                               str(tmp_path / "run"), "--ray-address", ray_head, "--nproc-per-node", "2",
                               "--distributed-timeout", "60"], env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        kill = subprocess.run([sys.executable, "-c", KILL_RANK1, ray_head], env=_env(), capture_output=True,
                              text=True, timeout=90)
        assert kill.returncode == 0, kill.stderr[-2000:]
        killed = time.monotonic()
        err = driver.communicate(timeout=60)[1]
    finally:
        driver.kill()
    assert time.monotonic() - killed < 20  # the grace for peers' errors (ray_launch.GRACE_S), not the timeout
    message = [line for line in err.splitlines() if line.startswith("lockstep train: error:")]
    assert driver.returncode == 1 and message, err[-3000:]
    assert message[0].startswith("lockstep train: error: rank 1 (lockstep-rank1-colocated on "), message[0]
    assert "): actor died: " in message[0], message[0]
    # rank 0: stopped in the rendezvous, or (a kill after it) failed against the closed peer and named
    assert message[0].endswith("(ranks 0 stopped)") or "; rank 0 (lockstep-rank0-colocated on " in message[0], \
        message[0]


def test_gpu_bundles_on_a_cpu_cluster_fail_after_the_timeout(tmp_path, ray_head):
    start = time.monotonic()
    cmd = [sys.executable, "-m", "lockstep.cli", "train", *SIZES, "--run-dir", str(tmp_path / "run"), "--device",
           "cuda", "--ray-address", ray_head, "--nproc-per-node", "2", "--distributed-timeout", "2"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("lockstep train: error: the Ray cluster had no room for 2 bundles of {'GPU': 1, 'CPU': 1} (PACK) "
            "within 2s (--distributed-timeout); it has {") in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 30 and not (tmp_path / "run").exists()
