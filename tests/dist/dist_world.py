"""Run a function on N local processes the way torchrun starts them (env:// variables), with a guard.

`run_world(fn, world_size, guard_s)` spawns `world_size` processes, each with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set as torch's launcher sets them, runs `fn(rank, *args)`
(fn must be a module-level function) and returns one `RankResult` per rank: its return value or the
exception it raised (type and message), or `hung=True` when it was still running after `guard_s`
seconds and was killed. A test that expects an error asserts on the message, and the guard turns a
hang into a failure instead of a stuck CI job.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world_size: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    start = time.monotonic()
    try:
        record = {"value": fn(rank, *args)}
    except BaseException as e:  # reported to the parent, which asserts on it
        record = {"error_type": type(e).__name__, "error": f"{e}\n{traceback.format_exc()}"}
    record["elapsed_s"] = time.monotonic() - start
    Path(out).write_bytes(pickle.dumps(record))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        # a rank whose peer died must not linger in process-group teardown
        os._exit(0)


def run_world(fn, world_size: int = 2, guard_s: float = 60.0, args: tuple = ()) -> list[RankResult]:
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, outs[r], args), daemon=True)
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
