"""Starting the world on a Ray cluster: one actor per rank, placed by one PACK placement group.

`lockstep train --ray-address auto|HOST:PORT --nproc-per-node N ...` is the torchrun job
(lockstep/dist/launch.py) with Ray doing the placement. The driver joins the cluster (after checking
that HOST:PORT answers: ray.init would retry for minutes), then

1. reserves N bundles in one PACK placement group: {"CPU": 1} each on the CPU, {"GPU": 1, "CPU": 1}
   on CUDA; it waits --distributed-timeout for the cluster to have room, then names what it lacks;
2. asks each bundle where it is (node IP, GPU ids) and gives the ranks to the bundles sorted by
   (node IP, GPU id), so rank order is stable and a node's ranks are neighbours;
3. starts one `RankActor` per rank in its bundle, named by the layout (`lockstep-rank0-trainer`,
   `lockstep-rank1-rollout`, or `-colocated`) in the job's own namespace;
4. has rank 0's actor pick its node IP and a free port (MASTER_ADDR / MASTER_PORT), and runs the
   per-rank entry in every actor with torchrun's variables set (`rank_env`) and the driver's torch /
   NCCL / gloo / lockstep settings (`forwarded_env`), so each joins with
   `lockstep.dist.groups.init_distributed` and runs exactly what a torchrun process runs;
5. waits for every actor. A failed rank (an exception, a non-zero exit, a dead actor) ends the
   driver with `RayLaunchError` naming the rank, and the failures of the other ranks that follow
   within `GRACE_S` (typically the peers' DistributedError naming the operation they were in); ranks
   still running when one finished are given --distributed-timeout, then stopped. Every actor is
   killed and the placement group removed on the way out, success or not.

`import ray` happens only here, and only when a Ray launch is asked for (the `ray` extra is optional).
Paths on the command line are the driver's: each actor runs in the driver's working directory when
that exists on its node (clusters with a shared filesystem), and rank 0 writes the run directory on
its node, as under torchrun.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from lockstep.dist.config import DistConfig

if TYPE_CHECKING:  # groups imports torch: the placement probes' workers import this module and need none
    from lockstep.dist.groups import Layout

INSTALL_HINT = "pip install 'lockstep-rl[ray]'"
# after the first failure, how long the driver still collects the other ranks' errors (a peer's
# DistributedError arrives within moments of the death it reports) before it stops them
GRACE_S = 2.0
FORWARDED_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "LOCKSTEP_")


class RayLaunchError(RuntimeError):
    """Ray is missing or unreachable, the cluster has no room, or a rank failed; the message names it."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayLaunchError(f"--ray-address needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


@dataclass(frozen=True)
class Place:
    """Where one placement-group bundle landed."""

    bundle: int
    node_ip: str
    gpu_ids: tuple[int, ...]


def rank_order(places: list[Place]) -> list[Place]:
    """The bundles in rank order: by node IP (as addresses, so 10.0.0.9 < 10.0.0.10), then GPU id."""
    def key(p: Place):
        ip = ipaddress.ip_address(p.node_ip)
        return ip.version, ip, p.gpu_ids, p.bundle
    return sorted(places, key=key)


def role(layout: Layout, rank: int) -> str:
    if layout.is_colocated:
        return "colocated"
    return "trainer" if rank in layout.trainer_ranks else "rollout"


def rank_env(rank: int, ordered: list[Place], master_addr: str, master_port: int, gpu: bool) -> dict[str, str]:
    """torchrun's variables for `rank` (groups.init_distributed reads them).

    LOCAL_RANK / LOCAL_WORLD_SIZE count the ranks that share this process's visible devices. On the
    CPU that is the node's ranks. A GPU actor sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES per
    actor): to it the node has one GPU and one rank, so 0 / 1, which makes groups._device pick cuda:0 (its
    GPU) and keeps NCCL (more local ranks than GPUs would mean ranks sharing a GPU, which moves to gloo)."""
    here = [p for p in ordered if p.node_ip == ordered[rank].node_ip]
    local_rank, local_world = (0, 1) if gpu else (here.index(ordered[rank]), len(here))
    return {"RANK": str(rank), "WORLD_SIZE": str(len(ordered)), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def forwarded_env(environ) -> dict[str, str]:
    """The driver's settings of torch, NCCL, gloo and lockstep (NCCL_*, TORCH_*, GLOO_*, LOCKSTEP_*), which
    torchrun's processes would inherit and Ray's workers (started by each node's raylet) do not; the
    two sides of a push must agree on e.g. NCCL_CUMEM_ENABLE (DISTRIBUTED.md)."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}


def _where() -> tuple[str, tuple[int, ...]]:
    import ray

    return ray.util.get_node_ip_address(), tuple(int(i) for i in ray.get_gpu_ids())


class RankActor:
    """One rank of the world (made a Ray actor by `ray.remote` in `launch_on_ray`)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:  # Ray prefixes the actor's output lines with it
        return self.name

    def master(self) -> tuple[str, int]:
        """This node's IP and a port free on it, for the rendezvous store rank 0 hosts."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def run(self, env: dict[str, str], cwd: str, entry: Callable[[list[str]], int], argv: list[str]) -> int:
        os.environ.update(env)
        if os.path.isdir(cwd):
            os.chdir(cwd)
        return entry(argv)


def launch_on_ray(config: DistConfig, device_type: str, entry: Callable[[list[str]], int], argv: list[str]) -> None:
    """Run `entry(argv)` as every rank of a config.world_size world on the Ray cluster at
    config.ray_address (module docstring); returns when every rank returned 0, else raises RayLaunchError.
    `entry` must be importable by reference (a module-level function): Ray pickles it to the actors."""
    from lockstep.dist.groups import Layout

    ray = import_ray()
    layout = Layout.from_config(config, config.world_size)  # a bad actor/rollout split fails before placing
    owns = not ray.is_initialized()
    if owns:
        _check_reachable(config.ray_address)
        try:
            ray.init(address=config.ray_address)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayLaunchError(f"--ray-address {config.ray_address}: cannot join the Ray cluster: {e}") from None
    try:
        _place_and_run(ray, config, layout, device_type == "cuda", entry, argv)
    finally:
        if owns:
            ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """HOST:PORT answers on TCP. ray.init keeps retrying an address where nothing listens (minutes, not a
    clear error), so the driver looks first. `auto` is Ray's own lookup of a local cluster, which fails fast."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise RayLaunchError(f"--ray-address {address}: expected `auto` or HOST:PORT of a Ray head")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RayLaunchError(f"--ray-address {address}: no Ray head answers there ({e}); start one with "
                             f"`ray start --head --port {port}` or give the head's HOST:PORT") from None


def _place_and_run(ray, config: DistConfig, layout: Layout, gpu: bool, entry, argv: list[str]) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle, timeout = ({"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}), config.distributed_timeout
    pg = placement_group([dict(bundle)] * layout.world_size, strategy="PACK")
    actors = []
    try:
        _reserve(ray, pg, layout.world_size, bundle, timeout)
        ordered = _ranked_places(ray, pg, layout.world_size, gpu, timeout)
        names = [f"lockstep-rank{r}-{role(layout, r)}" for r in range(layout.world_size)]
        actor = ray.remote(RankActor)
        actors = [actor.options(name=names[r], **_in_bundle(pg, p.bundle, gpu)).remote(names[r])
                  for r, p in enumerate(ordered)]
        master = _await(ray, actors[0].master.remote(), timeout, f"rank 0 ({names[0]}) did not start")
        shared = forwarded_env(os.environ)
        refs = {actors[r].run.remote({**shared, **rank_env(r, ordered, *master, gpu)}, os.getcwd(), entry, argv): r
                for r in range(layout.world_size)}
        _wait_all(ray, refs, [f"rank {r} ({names[r]} on {p.node_ip})" for r, p in enumerate(ordered)], timeout)
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)


def _in_bundle(pg, index: int, gpu: bool) -> dict:
    """Ray options that run a task or actor in bundle `index`, holding the bundle's CPU (and GPU)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": 1, "num_gpus": 1 if gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}


def _reserve(ray, pg, n: int, bundle: dict, timeout_s: float) -> None:
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RayLaunchError(f"the Ray cluster had no room for {n} bundles of {bundle} (PACK) within {timeout_s:g}s "
                             f"(--distributed-timeout); it has {ray.cluster_resources()}") from None


def _ranked_places(ray, pg, n: int, gpu: bool, timeout_s: float) -> list[Place]:
    """Where each bundle landed (a task in it reports), in rank order."""
    where = ray.remote(_where)
    found = _await(ray, [where.options(**_in_bundle(pg, i, gpu)).remote() for i in range(n)], timeout_s,
                   "the placement probes did not report")
    return rank_order([Place(i, ip, gpus) for i, (ip, gpus) in enumerate(found)])


def _await(ray, refs, timeout_s: float, what: str):
    """ray.get with the distributed timeout; a timeout or a Ray failure becomes RayLaunchError saying `what`."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RayLaunchError(f"{what} within {timeout_s:g}s (--distributed-timeout)") from None
    except ray.exceptions.RayError as e:
        raise RayLaunchError(f"{what}: {_summary(e)}") from None


def _wait_all(ray, refs: dict, names: list[str], timeout_s: float) -> None:
    """Wait for every rank's run; raise RayLaunchError naming each failed rank (module docstring, step 5)."""
    pending, failures, first_done, deadline = list(refs), [], None, None
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            break
        rank = refs[ready[0]]
        why = _failure(ray, ready[0])
        if why:
            failures.append(f"{names[rank]}: {why}")
        first_done = rank if first_done is None else first_done
        wait_s = GRACE_S if failures else timeout_s
        deadline = min(deadline or float("inf"), time.monotonic() + wait_s)
    stopped = ", ".join(str(refs[r]) for r in sorted(pending, key=refs.get))
    if failures:
        raise RayLaunchError("; ".join(failures) + (f" (ranks {stopped} stopped)" if pending else ""))
    if pending:
        raise RayLaunchError(f"ranks {stopped} still running {timeout_s:g}s (--distributed-timeout) after rank "
                             f"{first_done} finished; stopped")


def _failure(ray, ref) -> str | None:
    """Why a rank's run failed, in one line; None when it returned 0."""
    try:
        code = ray.get(ref)
    except ray.exceptions.RayTaskError as e:  # the entry raised: the rank's own exception
        cause = e.cause if isinstance(e.cause, BaseException) else e
        return f"{type(cause).__name__}: {_first_line(cause)}"
    except ray.exceptions.RayError as e:  # the actor died (killed, crashed, its node lost)
        return f"actor died: {_summary(e)}"
    return None if code == 0 else f"exited with code {code} (the rank's output above has its error)"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _summary(e: BaseException) -> str:
    """A Ray error's message without its trailing context (actor ids, pids), at most 300 characters."""
    return _first_line(e)[:300]
