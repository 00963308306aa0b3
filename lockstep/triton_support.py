"""Triton, loaded only where one of lockstep's kernels can run: on CUDA (or ROCm) builds of torch,
and under Triton's interpreter (TRITON_INTERPRET=1: the CPU tests run the kernels there).

Why not always: registering a kernel as a torch custom op (torch.library.triton_op) imports torch's
compiler stack (inductor, dynamo) to find the kernels inside it, ~2.5 s of every process start on a
2-core machine, and a CPU-only torch build can run none of them (they take CUDA tensors). There the
kernel modules see `triton is None`, as where Triton is not installed, and every caller takes its
PyTorch path, which is all such a process ever ran: a `lockstep train` process, or each rank of a
multi-process run, starts that much sooner."""

from __future__ import annotations

import os
from types import ModuleType

import torch


def interpreted() -> bool:
    """TRITON_INTERPRET is set: kernels run on the CPU (the tests), with their numeric bridges."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")


def load_triton() -> ModuleType | None:
    """The triton module where a kernel can run (a GPU build of torch, or the interpreter), else None
    (also where Triton is not installed)."""
    if torch.version.cuda is None and torch.version.hip is None and not interpreted():
        return None
    try:
        import triton
    except ImportError:
        return None
    if interpreted():
        _no_unasserted_overflow_checks()
    return triton


def _no_unasserted_overflow_checks() -> None:
    """The interpreter (Triton 3.9) evaluates an overflow check of every 32-bit integer add, sub
    and mul (widened to int64, compared with both bounds) and then drops it: the check is asserted in
    debug mode only, which its options keep off (a compiled kernel's unasserted checks are dead code
    the GPU compiler removes). The checks were ~25% of the interpreted kernels' time in a whole-rows
    CPU test (py-spy: the index arithmetic of every program; the test 66 -> 57 s on 2 cores). A
    Triton without these options keeps its own."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow") and not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def trainer_kernel_runs(x: torch.Tensor, enabled: bool | None) -> bool:
    """Where the trainer's Triton kernels with a backward (flash attention, RMSNorm, RoPE, MoE
    combine, logprobs) run, by their switch (kernel_switch.KernelSwitches): False: never; None (the
    default): on CUDA; True: also under the interpreter (the CPU tests; elsewhere on the CPU the
    eager ops run)."""
    if enabled is False:
        return False
    return x.is_cuda or (enabled is True and interpreted())


def trainer_kernel_takes(x: torch.Tensor, enabled: bool | None) -> bool:
    """`trainer_kernel_runs`, and x's dtype one they take: bf16 on CUDA (not fp32: tl.dot would
    multiply its tiles in tf32), bf16 or fp32 under the interpreter."""
    if not trainer_kernel_runs(x, enabled):
        return False
    return x.dtype == torch.bfloat16 if x.is_cuda else x.dtype in (torch.bfloat16, torch.float32)
