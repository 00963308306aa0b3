"""Fixtures shared by the device-aware 2-process tests (tests/dist/dist_world.py)."""

import pytest

from dist_world import world_devices


@pytest.fixture(scope="module", params=world_devices())
def device(request) -> str:
    """cpu (gloo, always) and cuda (NCCL, one GPU a rank; only with LOCKSTEP_TEST_DEVICE=cuda and 2 GPUs)."""
    return request.param
