"""Run a function on N local processes the way torchrun starts them (env:// variables), with a guard.

`run_world(fn, world_size, guard_s)` starts `world_size` processes (on the CPU forked from a fork
server that has imported torch and lockstep once per session, else spawned), each with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set as torch's launcher sets them, runs `fn(rank, *args)`
(fn must be a module-level function) and returns one `RankResult` per rank: its return value or the
exception it raised (type and message), or `hung=True` when it was still running after `guard_s`
seconds and was killed. A test that expects an error asserts on the message, and the guard turns a
hang into a failure instead of a stuck CI job.

Devices: `run_world(..., device="cpu")` (the default) hides any GPU from the ranks, so they run on
the CPU over gloo wherever the tests run; `device="cuda"` gives rank r `cuda:r` and the NCCL
backend (lockstep.dist.groups picks `cpu:gloo,cuda:nccl` when it sees a GPU). The 2-process tests
take their device from `world_devices()`: "cpu" always (CI), "cuda" too when LOCKSTEP_TEST_DEVICE=cuda
and enough GPUs are visible, else that variant is skipped (its CPU twin runs the same checks).
LOCKSTEP_TEST_DEVICE=cuda-shared runs the "cuda" variants on ONE GPU: every rank on cuda:0, CUDA
tensors over gloo (lockstep.dist.groups picks gloo when a node has more ranks than GPUs).
On CUDA the tests also `report()` what they compared (bitwise or the largest difference) as JSON
lines, printed and appended to the file LOCKSTEP_DIST_REPORT names, if set.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import tempfile
import time
import contextlib
import json
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

TEST_DEVICE = os.environ.get("LOCKSTEP_TEST_DEVICE", "cpu")


def cuda_world(world_size: int = 2) -> bool:
    """LOCKSTEP_TEST_DEVICE=cuda and at least `world_size` GPUs, or cuda-shared and one GPU: the CUDA variants run."""
    if TEST_DEVICE == "cuda-shared":
        return torch.cuda.is_available()
    return TEST_DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def shared_gpu() -> bool:
    """The CUDA variants run with every rank on one GPU, over gloo (module docstring)."""
    return TEST_DEVICE == "cuda-shared"


def world_devices(world_size: int = 2) -> list:
    """pytest params of a device-aware multi-process test: cpu (gloo), and cuda (NCCL, one GPU a rank)."""
    skip = pytest.mark.skipif(not cuda_world(world_size), reason=f"needs LOCKSTEP_TEST_DEVICE=cuda and {world_size} "
                              "GPUs; the cpu variant runs the same checks over gloo")
    return [pytest.param("cpu"), pytest.param("cuda", marks=skip)]


# a device-aware test whose check is host-side (offload, resume): its CPU world only, no CUDA variant
cpu_world_only = pytest.mark.parametrize("device", ["cpu"], scope="module")


def device_scenarios(scenarios, cuda_scenarios, world_size: int = 2) -> list:
    """(device, scenario) params: every scenario on the CPU, the CUDA ones also on the GPUs."""
    return [pytest.param(d.values[0], name, marks=d.marks) for d in world_devices(world_size) for name in scenarios
            if d.values[0] == "cpu" or name in cuda_scenarios]


def rank_values(results: list) -> list:
    """Each rank's return value; fails the test with every rank's error when one raised or hung."""
    assert all(r.ok for r in results), [r.error or (f"rank {r.rank} hung" if r.hung else None) for r in results]
    return [r.value for r in results]


def to_cpu(obj):
    """Tensors anywhere in nested dicts / lists / tuples moved to the CPU (results cross processes)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| (0.0: bitwise equal; inf: shapes or dtypes differ or a NaN moved)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    if torch.equal(got, want):
        return 0.0
    if not got.is_floating_point():
        return float("inf")
    return float((got.double() - want.double()).abs().max())


def report(**fields) -> None:
    """One measurement of a device run: printed and appended to $LOCKSTEP_DIST_REPORT as a JSON line."""
    line = json.dumps(fields, default=str)
    print(f"REPORT {line}", flush=True)
    path = os.environ.get("LOCKSTEP_DIST_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@contextlib.contextmanager
def _child_env(device: str):
    """The environment the spawned ranks inherit: no visible GPU for a cpu world."""
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif device != "cuda":
        raise ValueError(f"run_world: device {device!r} is not cpu or cuda")
    # what the ranks run with (_entry sets it too); a fork server started now imports torch without
    # an OpenMP thread pool, which its forked ranks could not use
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    exitcode: int | None = None
    hung: bool = False
    elapsed_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None and not self.hung and self.exitcode == 0


FIRST_PORT = 20_000  # above Ray's default worker ports (free_port)


def free_port() -> int:
    """A free port for a world's TCPStore, drawn below the kernel's ephemeral range: a port the
    kernel hands out (bind to 0) is free when this returns, but the outgoing connections that gloo's
    ranks of another world open take ephemeral ports and took one before the store bound it
    (EADDRINUSE in CI); those never use a port outside that range. Above Ray's worker ports
    (10002-19999 by default): a Ray head given one of those as its port refuses to start."""
    low = _ephemeral_range()[0]
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(FIRST_PORT, max(low, FIRST_PORT + 1))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found in [{FIRST_PORT}, {low}) after 200 draws")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except OSError:  # not Linux: IANA's dynamic range
        low, high = 49152, 65535
    return low, high


def _entry(fn, rank: int, world_size: int, port: int, out: str, args: tuple, env: dict) -> None:
    # the parent's environment when it started the world, as a spawned process inherits it (a rank
    # forked from the fork server would otherwise have the server's, from the session's first world)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    start = time.monotonic()
    try:
        record = {"value": to_cpu(fn(rank, *args))}
    except BaseException as e:  # reported to the parent, which asserts on it
        record = {"error_type": type(e).__name__, "error": f"{e}\n{traceback.format_exc()}"}
    record["elapsed_s"] = time.monotonic() - start
    Path(out).write_bytes(pickle.dumps(record))
    try:
        import torch.distributed as dist

        # after a failure the peers may be gone: NCCL's teardown can wait for them, so skip it
        if dist.is_initialized() and "error_type" not in record:
            dist.destroy_process_group()
    finally:
        # a rank whose peer died must not linger in process-group teardown
        os._exit(0)


# What the CPU ranks import, imported once per session by the fork server they are forked from
# (_context). Module names only: Python 3.11's server ignores the parent's sys.path (tests/dist).
RANK_PRELOAD = ["torch", "torch.distributed", "pytest", "transformers.models.auto.tokenization_auto",
                "lockstep.cli", "lockstep.commands.train", "lockstep.rl.loop", "lockstep.rl.char_tokenizer",
                "lockstep.engine.engine", "lockstep.models", "lockstep.train.trainer", "lockstep.dist.groups",
                "lockstep.dist.fsdp", "lockstep.dist.expert_parallel", "lockstep.dist.engine_expert_parallel",
                "lockstep.dist.pipeline_parallel", "lockstep.dist.pipeline_trainer",
                "lockstep.dist.pipeline_expert_parallel", "lockstep.dist.replicas", "lockstep.dist.sample_gather",
                "lockstep.dist.weight_push"]


def _context(device: str):
    """How the ranks' processes start. CPU ranks (CI) fork from a fork server that imported torch and
    lockstep's rank code once per session (RANK_PRELOAD): a spawned rank spent seconds of a 2-core
    machine importing them again, in each of the ~40 worlds the tests start. Anything that may touch a
    GPU is spawned, as torch advises for CUDA."""
    if device == "cpu" and TEST_DEVICE == "cpu":
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(RANK_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def run_world(fn, world_size: int = 2, guard_s: float = 60.0, args: tuple = (),
              device: str = "cpu") -> list[RankResult]:
    ctx = _context(device)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        with _child_env(device):
            env = dict(os.environ)
            procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, outs[r], args, env), daemon=True)
                     for r in range(world_size)]
            for p in procs:
                p.start()
        deadline = time.monotonic() + guard_s
        results = []
        for r, p in enumerate(procs):
            p.join(max(0.0, deadline - time.monotonic()))
            hung = p.is_alive()
            if hung:
                p.kill()
                p.join()
            res = RankResult(rank=r, exitcode=p.exitcode, hung=hung)
            if os.path.exists(outs[r]):
                for k, v in pickle.loads(Path(outs[r]).read_bytes()).items():
                    setattr(res, k, v)
            results.append(res)
        return results


def held_while_saving(trainer, save) -> dict[str, list[int]]:
    """Run `save()` with `trainer`'s named_weights and optimizer.state_entries recorded: for each tensor
    they yield, how many of the ones of its kind yielded before are still alive at that moment (0 all
    along: a save that gathers one tensor at a time and keeps none)."""
    import weakref

    held: dict[str, list[int]] = {"weights": [], "optimizer state": []}

    def recording(kind: str, inner):
        def tensors():
            refs = []
            for key, t in inner():  # a tensor is freed when its last reference goes: no gc pass needed
                held[kind].append(sum(ref() is not None for ref in refs))
                refs.append(weakref.ref(t))
                yield key, t
        return tensors

    trainer.named_weights = recording("weights", trainer.named_weights)
    trainer.optimizer.state_entries = recording("optimizer state", trainer.optimizer.state_entries)
    try:
        save()
    finally:
        del trainer.named_weights, trainer.optimizer.state_entries
    return held
