"""The process world of one lockstep job: default group, the four groups, timeouts, clear failures.

`init_distributed(timeout_s)` joins the world torch's launcher (torchrun / `torch.distributed.run`)
describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; env://
rendezvous) and makes, once and in this order on every rank (the order is what keeps group
creation from deadlocking, THUDM/slime#2331):

    trainer group  the training ranks (FSDP / EP / PP meshes are carved from them)
    engine group   the serving ranks
    control group  every rank, always gloo: barriers, flags, small metadata; CPU-only, so idle
                   ranks never trip an NCCL watchdog during long rollouts (verl#2995)
    weight group   the trainer source rank (the first trainer rank) + every engine rank

Layouts: colocated (every rank trains and serves, trainer = engine = all ranks) and disaggregated
(ranks [0, T) train, [T, N) serve). A rank outside a group holds None for it.

Every group gets the same finite timeout. Every lockstep collective runs inside
`collective("what")`, which turns a timeout or a dead peer into `DistributedError` naming the rank,
the operation and the time waited, so a broken run ends with a sentence instead of a hang or a
bare gloo trace. (gloo raises on its own timeout and at once when a peer's socket closes.)

NCCL notices no dead peer by itself: a collective waits until the timeout. Its host-side `wait()`
only orders CUDA streams, so lockstep's asynchronous collectives wait through `DistContext.wait`,
which blocks the host for at most the timeout and then raises (torch aborts the communicator first,
so the stuck kernel returns). On CUDA `init_distributed` sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2
(CleanUpOnly) unless it is set: torch's default (3) lets the NCCL watchdog end the process at the
timeout before that error reaches Python; with 2 the watchdog aborts the communicators and the
waiting thread raises the error that names rank and operation.

A rank that dies (killed, crashed) makes torch's launcher stop the others with SIGTERM within its
monitor interval (0.1 s), often before they reach a collective that would fail against the dead
peer: their default SIGTERM death would leave the launcher's summary with the dead rank alone. In a
torchrun-started process `init_distributed` turns that SIGTERM into `DistributedError` "rank R:
stopped by the launcher (SIGTERM) in / after OP" (the collective it was in or last ran), which
torch's @record writes where the launcher's summary shows it (tests/dist/test_rank_killed.py).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from lockstep.dist.config import DistConfig

DEFAULT_TIMEOUT_S = 600.0

# The configured timeout of the current world, for error messages: torch keeps the world itself
# process-global, and `collective` must not need a context threaded through every call site.
_world_timeout_s: float | None = None
# the collective this process is in, the last one it entered and whether one failed, for the
# launcher-stop message (`_on_launcher_stop`)
_ops: dict = {"current": None, "last": None, "failed": False}


class DistributedError(RuntimeError):
    """A collective timed out or a peer failed; the message names the rank and the operation."""


@dataclass(frozen=True)
class Layout:
    """Which global ranks train and which serve."""

    world_size: int
    trainer_ranks: tuple[int, ...]
    engine_ranks: tuple[int, ...]

    @classmethod
    def colocated(cls, world_size: int) -> "Layout":
        every = tuple(range(world_size))
        return cls(world_size, every, every)

    @classmethod
    def disaggregated(cls, n_trainer: int, n_engine: int) -> "Layout":
        return cls(n_trainer + n_engine, tuple(range(n_trainer)), tuple(range(n_trainer, n_trainer + n_engine)))

    @classmethod
    def from_config(cls, config: DistConfig, world_size: int) -> "Layout":
        if config.colocated:
            return cls.colocated(world_size)
        if config.actor_num_gpus + config.rollout_num_gpus != world_size:
            raise ValueError(f"DistConfig: actor_num_gpus {config.actor_num_gpus} + rollout_num_gpus "
                             f"{config.rollout_num_gpus} != world size {world_size}")
        return cls.disaggregated(config.actor_num_gpus, config.rollout_num_gpus)

    @property
    def is_colocated(self) -> bool:
        return self.trainer_ranks == self.engine_ranks

    @property
    def weight_src(self) -> int:
        """The global rank that broadcasts pushed weights: the first trainer rank."""
        return self.trainer_ranks[0]

    @property
    def weight_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({self.weight_src, *self.engine_ranks}))


@dataclass(frozen=True)
class DistContext:
    """This process's place in the world and the groups it belongs to (None where it is not a member)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout_s: float
    layout: Layout
    trainer_group: dist.ProcessGroup | None
    engine_group: dist.ProcessGroup | None
    control_group: dist.ProcessGroup
    weight_group: dist.ProcessGroup | None

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.layout.trainer_ranks

    @property
    def is_engine(self) -> bool:
        return self.rank in self.layout.engine_ranks

    @property
    def weight_src(self) -> int:
        return self.layout.weight_src

    def collective(self, op: str):
        """`collective(op)` with this world's rank and timeout."""
        return collective(op, rank=self.rank, timeout_s=self.timeout_s)

    def computing(self, op: str):
        """`computing(op)` with this world's rank and timeout."""
        return computing(op, rank=self.rank, timeout_s=self.timeout_s)

    def wait(self, work, op: str) -> None:
        """Wait for an asynchronous collective's `work`, failing with `op` named. On CUDA the host
        waits (at most the timeout), so a dead NCCL peer raises here, not later as a stuck host sync."""
        with self.collective(op):
            if self.device.type == "cuda":
                work.wait(datetime.timedelta(seconds=self.timeout_s))
            else:
                work.wait()

    def barrier(self, op: str) -> None:
        """Barrier on the gloo control group (every rank), failing with `op` named."""
        with self.collective(f"barrier {op}"):
            dist.barrier(group=self.control_group)

    def all_true(self, flag: bool, op: str) -> bool:
        """True on every rank iff `flag` is true on every rank (a MIN all-reduce on the control group)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        with self.collective(f"all_true {op}"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return bool(t.item())


def launched() -> bool:
    """True in a process started by torch's launcher (its env:// variables are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _default_backend(device: torch.device) -> str:
    """CUDA: NCCL for CUDA tensors, gloo for the CPU tensors some callers hand the default group.
    More local ranks than GPUs (a 2-process run on a 1-GPU machine: ranks share a device, `_device`)
    moves CUDA tensors over gloo too: NCCL refuses two ranks on one GPU ("Duplicate GPU detected")."""
    if device.type != "cuda":
        return "gloo"
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count():
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def _group(ranks: tuple[int, ...], timeout: datetime.timedelta, backend: str | None):
    # every rank calls new_group for every group, member or not, in the same order
    group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
    return None if group == dist.GroupMember.NON_GROUP_MEMBER else group


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, *, layout: Layout | None = None,
                     config: DistConfig | None = None, backend: str | None = None) -> DistContext:
    """Join the world from torchrun's environment and make the four groups (module docstring).

    `layout` wins over `config` (its actor/rollout GPU counts); neither: colocated. `backend`
    overrides the default (gloo on CPU; NCCL + gloo on CUDA), e.g. "gloo" for CUDA tensors over gloo.
    """
    global _world_timeout_s
    if not launched():
        raise DistributedError("init_distributed: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set; "
                               "start the job with torchrun or `lockstep train --nproc-per-node N`")
    if not timeout_s > 0:
        raise ValueError(f"init_distributed: timeout_s must be > 0, got {timeout_s}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = _device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # CleanUpOnly: the watchdog aborts timed-out communicators and leaves the error to the
        # waiting thread (module docstring); read when the NCCL groups are made
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = datetime.timedelta(seconds=timeout_s)
    _world_timeout_s = timeout_s
    with collective("init_process_group (rendezvous)", rank=rank, timeout_s=timeout_s):
        dist.init_process_group(backend=backend or _default_backend(device), init_method="env://",
                                rank=rank, world_size=world_size, timeout=timeout)
    if dist.get_world_size() != world_size:
        raise DistributedError(f"rank {rank}: world size {dist.get_world_size()} != WORLD_SIZE {world_size}")
    if layout is None:
        layout = Layout.from_config(config or DistConfig(), world_size)
    if layout.world_size != world_size:
        raise ValueError(f"rank {rank}: layout is for {layout.world_size} ranks, the world has {world_size}")
    with collective("new_group (trainer, engine, control, weight)", rank=rank, timeout_s=timeout_s):
        trainer = _group(layout.trainer_ranks, timeout, backend)
        engine = _group(layout.engine_ranks, timeout, backend)
        control = _group(tuple(range(world_size)), timeout, "gloo")
        weight = _group(layout.weight_ranks, timeout, backend)
    _report_launcher_stop()
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                       timeout_s=timeout_s, layout=layout, trainer_group=trainer, engine_group=engine,
                       control_group=control, weight_group=weight)


def destroy_distributed() -> None:
    """Leave the world (all groups); safe to call when not initialised."""
    global _world_timeout_s
    if dist.is_initialized():
        dist.destroy_process_group()
    _world_timeout_s = None


def _report_launcher_stop() -> None:
    """In a torchrun-started process (its agent sets TORCHELASTIC_RUN_ID), SIGTERM raises the
    DistributedError of `_on_launcher_stop` (module docstring). Signal handlers live in the main
    thread only; elsewhere (an actor's worker thread) the default stays. It stays installed after
    `destroy_distributed`: a failed rank's launcher SIGTERM may come between that teardown and torch's
    @record writing the error, and must not kill the process before the error is written."""
    if "TORCHELASTIC_RUN_ID" in os.environ and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_launcher_stop)
        # `kill -USR1 PID` prints every thread's Python stack to stderr: a rank that does not answer
        # its launcher (stuck in native code, where the SIGTERM handler above cannot run) says where
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _on_launcher_stop(signum, frame) -> None:
    # once: the exit that follows (torch's @record writing the error) must not be cut short by a
    # second signal; the launcher SIGKILLs a process that has not exited after its shutdown timeout
    signal.signal(signum, signal.SIG_IGN)
    if _ops["failed"] or not dist.is_initialized():
        return  # already leaving with a collective's error, or after the world's teardown: let it exit
    current, last = _ops["current"], _ops["last"]
    where = f"in {current}" if current else f"after {last}" if last else "before its first collective"
    raise DistributedError(f"rank {dist.get_rank()}: stopped by the launcher (SIGTERM) {where}: another rank "
                           "failed (the launcher's root cause names it) or the job was stopped")


def _describe(op: str, rank: int | None, timeout_s: float | None, waited_s: float, error: BaseException) -> str:
    who = f"rank {rank}" if rank is not None else "rank ?"
    if timeout_s is not None and waited_s >= 0.9 * timeout_s:
        what = f"timed out after {timeout_s:g}s"
    else:
        limit = f" (timeout {timeout_s:g}s)" if timeout_s is not None else ""
        what = f"failed after {waited_s:.1f}s{limit}, a peer probably exited"
    return f"{who}: {op} {what}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"


@contextlib.contextmanager
def collective(op: str, *, rank: int | None = None, timeout_s: float | None = None) -> Iterator[None]:
    """Run torch.distributed calls; a timeout or peer failure inside raises `DistributedError`
    "rank R: OP timed out after Ts: ..." (or "failed after Ws ..."). Rank and timeout default to
    the current world's."""
    with _named(op, rank, timeout_s, lambda error: True, waits=True):
        yield


@contextlib.contextmanager
def computing(op: str, *, rank: int | None = None, timeout_s: float | None = None) -> Iterator[None]:
    """Computation with collectives inside that lockstep does not issue itself (FSDP's all-gathers and
    reduce-scatters in a train step's forward and backward): a collective's failure there raises
    `DistributedError` naming the rank and `op`, as `collective` does; any other error (a bug, an
    out-of-memory) passes unchanged, not mistaken for a dead peer. A launcher's SIGTERM meanwhile
    names `op` too. The time it reports is the computation's so far, never called a timeout."""
    with _named(op, rank, timeout_s, from_a_collective, waits=False):
        yield


def from_a_collective(error: BaseException) -> bool:
    """Whether a RuntimeError came from a torch.distributed collective: torch's DistError family
    (NCCL's, the store's, timeouts) or gloo's transport errors, which are plain RuntimeErrors whose
    message carries gloo's source path."""
    return isinstance(error, dist.DistError) or "gloo" in str(error)


@contextlib.contextmanager
def _named(op: str, rank: int | None, timeout_s: float | None, converts, waits: bool) -> Iterator[None]:
    """`op` as this process's current operation (the launcher-stop message names it); a RuntimeError
    inside that `converts(error)` says is distributed becomes a DistributedError naming rank and op
    (`waits`: op is a wait, whose length near the timeout means it timed out)."""
    if rank is None and dist.is_initialized():
        rank = dist.get_rank()
    if timeout_s is None:
        timeout_s = _world_timeout_s
    start, outer = time.monotonic(), _ops["current"]
    _ops["current"] = _ops["last"] = op
    try:
        yield
    except DistributedError:
        raise
    except RuntimeError as e:  # torch.distributed.DistError and gloo's errors are RuntimeErrors
        if not converts(e):
            raise
        _ops["failed"] = True
        waited_s = time.monotonic() - start
        raise DistributedError(_describe(op, rank, timeout_s if waits else None, waited_s, e)) from e
    finally:
        _ops["current"] = outer
