"""Where device-generic tests run: the CPU (Triton under its interpreter, conftest.py) unless
LOCKSTEP_TEST_DEVICE=cuda or cuda-shared, which runs them, kernels compiled, on a GPU."""

import os

DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE", "cpu").startswith("cuda") else "cpu"
