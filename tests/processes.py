"""The environment of the `lockstep` processes the tests start (subprocess, not run_world's ranks)."""

import os

# a launcher started inside another's world would join it
DIST_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def cli_env(**extra: str) -> dict:
    """This process's environment for a child `lockstep` process: one OpenMP thread (2 cores, several
    processes), no torch.distributed variables, and no TRITON_INTERPRET, which tests/conftest.py sets
    for the interpreted kernels of this process: a child on the CPU runs the default path, which runs no
    Triton kernel, and without the variable it skips loading Triton and torch's compiler stack
    (lockstep/triton_support.py), ~2.5 s of each process start."""
    skip = (*DIST_VARIABLES, "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in skip}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env
