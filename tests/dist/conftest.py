"""Fixtures shared by the device-aware 2-process tests (tests/dist/dist_world.py), and the `lockstep
train` runs that several modules compare with (test_train_world.py's RUN)."""

import json

import pytest

from dist_world import free_port, world_devices


@pytest.fixture(scope="module", params=world_devices())
def device(request) -> str:
    """cpu (gloo, always) and cuda (NCCL, one GPU a rank; only with LOCKSTEP_TEST_DEVICE=cuda and 2 GPUs)."""
    return request.param


# The reference runs of test_train_world.py, test_ray_launch.py and test_pipeline_expert_parallel.py:
# session-scoped, so each runs once (a `lockstep train` process start is ~20 s on a 2-core machine).

@pytest.fixture(scope="session")
def one_process(tmp_path_factory) -> list[dict]:
    """metrics.jsonl of test_train_world.RUN on one process."""
    from test_train_world import _train

    return _train(tmp_path_factory.mktemp("one"))


@pytest.fixture(scope="session")
def two_processes(tmp_path_factory) -> list[dict]:
    """metrics.jsonl of test_train_world.RUN on 2 processes (`--nproc-per-node 2`: torch's launcher)."""
    from test_train_world import _train

    run_dir = tmp_path_factory.mktemp("two")
    lines = _train(run_dir, "--nproc-per-node", "2", "--master-port", str(free_port()))
    assert json.loads((run_dir / "config.json").read_text())["world_size"] == 2
    return lines
