"""Starting the world with torch's own launcher (`torch.distributed.run`, what `torchrun` runs).

`lockstep train --nproc-per-node N ...` and `torchrun --nproc-per-node N -m lockstep.cli train ...`
are the same job: the command, seeing launch flags and no launcher environment, calls
`launch(config, ["-m", "lockstep.cli", *argv_without_launch_flags])`; each started process finds
RANK / WORLD_SIZE / MASTER_ADDR set (`groups.launched()`) and joins with `init_distributed`.
The static rendezvous (--master-addr / --master-port, --node-rank) is torchrun's default c10d-free
one; multi-node jobs start the same command on every node with its own --node-rank.
"""

from __future__ import annotations

from lockstep.dist.config import DistConfig
from lockstep.dist.groups import launched

# DistConfig fields that describe the launch; a started process must not launch again
LAUNCH_FIELDS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "ray_address")


def should_launch(config: DistConfig) -> bool:
    """More than one process (or a Ray cluster) is asked for and this process was not started by a launcher."""
    return (config.world_size > 1 or config.ray_address is not None) and not launched()


def torchrun_args(config: DistConfig, entry: list[str]) -> list[str]:
    """torch.distributed.run's arguments for `config`, then the entry (a script path or `-m module`) and its args."""
    return ["--nproc-per-node", str(config.nproc_per_node), "--nnodes", str(config.nnodes),
            "--node-rank", str(config.node_rank), "--master-addr", config.master_addr,
            "--master-port", str(config.master_port), *entry]


def strip_launch_flags(argv: list[str]) -> list[str]:
    """argv without the launch flags (`--flag value` and `--flag=value`), for the started processes."""
    flags = {"--" + f.replace("_", "-") for f in LAUNCH_FIELDS}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif arg.split("=", 1)[0] not in flags:
            out.append(arg)
    return out


def launch(config: DistConfig, entry: list[str]) -> None:
    """Run `entry` on config.nproc_per_node local processes of a config.world_size world and wait.
    A failed rank makes torch's launcher stop the others and raise ChildFailedError (rank, exit
    code, its traceback)."""
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_args(config, entry))
