"""A rank SIGKILLed mid-run of a real `lockstep train --nproc-per-node 2`, 4 or 8 (issues 13 / 18 / 19).

The launcher (torch's `torch.distributed.run`, in the `lockstep train` process) is started with
`--distributed-timeout 20` and enough rollouts that it is still running; once rank 0 has logged the
metrics line of a trained rollout, one worker is SIGKILLed. The job must end non-zero within the timeout (plus a margin
for the launcher's shutdown), its summary naming the killed rank (torch's "Root Cause") and the
surviving rank with the operation it was in or had last run (lockstep's DistributedError), and no
process of the job may be left. Killed: the worker that is not rank 0, rank 0 (the launcher's
rendezvous store lives in the launcher, so the survivor still reports), and in the disaggregated
layout (1 trainer + 1 engine) the engine rank; and a middle stage's rank of a PP 4 x EP 2 run on 8
processes (issue 19's layout: the pipeline's sends and the experts' all-to-alls; its CUDA variant needs
8 GPUs). A PP 2 x EP 2 run on 4 processes (rank 3 killed) was one more case until the suite's 15-minute
budget came close (~25-40 s on 2 cores): the PP 4 x EP 2 case meets both kinds of wait and more stages.

What ends the job: torch's launcher polls its workers every 0.1 s and, at the first that died,
SIGTERMs the others. A survivor waiting in a gloo collective fails at once against the closed socket
("... failed after 0.0s ..., a peer probably exited"); one that is computing is stopped by that
SIGTERM, which lockstep turns into "rank R: stopped by the launcher (SIGTERM) after OP"
(lockstep/dist/groups.py). Which of the two a run shows depends on where the kill lands, so the test
accepts either; both name the survivor and an operation. On CUDA (LOCKSTEP_TEST_DEVICE=cuda) the same
runs use one GPU per rank; a survivor blocked in an NCCL wait reports at the timeout instead.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_world import free_port, report, world_devices
from processes import cli_env

TIMEOUT_S = 20
MARGIN_S = 15  # the launcher's poll, the survivor's exit and torch's summary; measured ~1 s on the CPU
NUM_ROLLOUT = 60  # far more than run before the kill (~1 s per rollout here): the kill lands mid-run
# 2 eval prompts (one a rank): step 0's eval only delays the first trained rollout the kill waits for
RUN = ["--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
       "--eval-interval", "1000", "--eval-prompts-limit", "2", "--no-plot", "--distributed-timeout", str(TIMEOUT_S)]
# layout: (flags, processes)
LAYOUTS = {"colocated": ([], 2), "disaggregated": (["--actor-num-gpus", "1", "--rollout-num-gpus", "1"], 2),
           "pp4-ep2": (["--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "2"], 8)}
# (layout, killed rank); pp4-ep2 (issue 19's layout): rank 5 holds stage 2 of pipeline 1, between two stages,
# so its death leaves ranks in a pipeline send / receive and its expert-parallel partner in an all-to-all
SCENARIOS = [("colocated", 1), ("colocated", 0), ("disaggregated", 1), ("pp4-ep2", 5)]


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc: its children, theirs, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # exited while listed
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state, ppid, ...
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _wait_mid_run(proc: subprocess.Popen, metrics: Path, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not (metrics.is_file() and "train/step" in metrics.read_text()):  # a rollout trained, not step 0's eval
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before logging a line: {proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no metrics line after {limit_s}s")
        time.sleep(0.1)


def _start(run_dir: Path, device: str, layout: str) -> subprocess.Popen:
    env = cli_env()
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU wherever the test runs
    flags = ["--device", "cuda", "--no-compile-decode", "--no-compile-prefill"] if device == "cuda" else []
    layout_flags, nproc = LAYOUTS[layout]
    cmd = [sys.executable, "-m", "lockstep.cli", "train", *RUN, *flags, *layout_flags, "--run-dir", str(run_dir),
           "--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _survivor_operation(stderr: str, rank: int) -> str | None:
    """The operation rank `rank`'s DistributedError names: the collective that failed against the
    dead peer, or the one it was in / had last run when the launcher's SIGTERM stopped it."""
    failed = re.search(rf"DistributedError: rank {rank}: (.+?) (failed after|timed out after)", stderr)
    stopped = re.search(rf"DistributedError: rank {rank}: stopped by the launcher \(SIGTERM\) (?:in|after) (.+?): "
                        "another rank failed", stderr)
    return (failed or stopped).group(1) if failed or stopped else None


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _workers(job: list[int]) -> dict[int, int]:
    """{rank: pid} of the job's rank processes. Their own children (torch.compile's worker pool on a
    GPU) inherit RANK too; a rank is the process whose parent has none."""
    return {_rank_of(pid): pid for pid in job if _rank_of(pid) is not None and _rank_of(_parent(pid) or 0) is None}


def _kill_rank(proc: subprocess.Popen, victim: int, nproc: int) -> list[int]:
    """SIGKILL the worker of rank `victim`; every process of the job at that moment."""
    job = _descendants(proc.pid)
    workers = _workers(job)
    assert sorted(workers) == list(range(nproc)), f"workers by rank: {workers}"
    os.kill(workers[victim], signal.SIGKILL)
    return job


@pytest.mark.parametrize("device, scenario", [pytest.param(d.values[0], s, marks=d.marks, id=f"{d.values[0]}-{s[0]}"
                                                           f"-kill{s[1]}") for s in SCENARIOS
                                              for d in world_devices(LAYOUTS[s[0]][1])])
def test_killed_rank_ends_the_job_naming_the_survivor_and_its_operation(tmp_path, device, scenario):
    layout, victim = scenario
    survivors = [r for r in range(LAYOUTS[layout][1]) if r != victim]
    proc = _start(tmp_path / "run", device, layout)
    _wait_mid_run(proc, tmp_path / "run" / "metrics.jsonl", limit_s=300)
    job = _kill_rank(proc, victim, LAYOUTS[layout][1])
    killed_at = time.monotonic()
    try:
        stderr = proc.communicate(timeout=TIMEOUT_S + MARGIN_S)[1]
    except subprocess.TimeoutExpired:
        for pid in (pid for pid in _workers(job).values() if _alive(pid)):
            os.kill(pid, signal.SIGUSR1)  # lockstep.dist.groups: each live rank prints its stacks
        time.sleep(2)
        _kill_all([proc.pid, *job])
        stacks = proc.communicate()[1]
        pytest.fail(f"the launcher still ran {TIMEOUT_S + MARGIN_S}s after rank {victim} was killed; "
                    f"stderr with the live ranks' stacks:\n{stacks[-6000:]}")
    seconds = time.monotonic() - killed_at
    report(test="rank_killed", device=device, layout=layout, killed=victim, seconds_to_exit=round(seconds, 2),
           survivor_errors=[line.strip() for line in stderr.splitlines() if "DistributedError: rank " in line])
    logged = len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert proc.returncode != 0 and logged < NUM_ROLLOUT, (proc.returncode, logged)
    # the launcher's summary names the killed rank (SIGKILL) as the root cause, or, when the survivor's
    # error was observed first (on 2 H200s its gloo gather failed within 0.0 s of the kill, and the
    # summary then listed only the survivor), the survivor's error says a peer exited
    victim_named = re.search(rf"rank\s*: {victim} .*\n.*exitcode\s*: -9 .*SIGKILL", stderr)
    peer_exit_named = re.search(r"DistributedError: rank \d+: .+ a peer probably exited", stderr)
    assert victim_named or peer_exit_named, stderr[-3000:]
    # a survivor names the operation it was in (with more ranks, those the launcher stopped first may not)
    assert any(_survivor_operation(stderr, r) for r in survivors), stderr[-4000:]
    assert not [pid for pid in job if _alive(pid)], f"left behind: {[pid for pid in job if _alive(pid)]}"
