"""When one of lockstep's forward-only Triton kernels may stand in for the torch ops it replaces.

The kernels (grouped_gemm_triton.py, hc_projection_triton.py) have no backward, so they run only
where no gradient is wanted (the engine, the trainer's scoring passes); only on CUDA; and each can
be switched off by its environment variable (`LOCKSTEP_TRITON_MOE=0`, `LOCKSTEP_TRITON_HC=0`) to
compare against the torch path. Each caller adds its own shape checks.
"""

from __future__ import annotations

import os

import torch


def forward_kernel_allowed(switch: str, *tensors: torch.Tensor) -> bool:
    """On CUDA, no gradient wanted through `tensors`, and the environment variable `switch` not "0"."""
    if not tensors[0].is_cuda or os.environ.get(switch, "1") == "0":
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
