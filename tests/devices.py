"""Where device-generic tests run: the CPU (Triton under its interpreter, conftest.py) unless
LOCKSTEP_TEST_DEVICE=cuda or cuda-shared, which runs them, kernels compiled, on a GPU."""

import os

import torch

DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE", "cpu").startswith("cuda") else "cpu"

# what the trainer's Triton kernels take (triton_support.trainer_kernel_takes): bf16 on a GPU (fp32
# tiles would multiply in tf32 there), fp32 and bf16 under the interpreter
KERNEL_DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cpu" else [torch.bfloat16]
