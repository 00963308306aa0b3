"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels, behind
LOCKSTEP_PDL=1 (off until timed in the decode step).

Why: a graph-replayed 1b decode step is ~165 kernels, most a few microseconds, with ~95 us of idle
device time between them (rollout_throughput.py --step-trace). With PDL a kernel is launched while
the one before it still runs and waits for it inside (`griddepcontrol.wait`), so its launch and
prologue overlap the previous kernel's tail: on one H200, a chain of 200 small Triton kernels
replayed from a CUDA graph took 0.67 us a kernel against 1.04 (0.26 MB each; docs/speed.md,
2026-12-05).

How: each decode kernel takes `PDL: tl.constexpr` and starts with `pdl_start(PDL)` (wait for the
previous grid, then let the next one launch); `launch(wrap_triton(kernel), grid)` launches it with PDL
and `launch_pdl=True` where enabled, else through wrap_triton with PDL off. Inductor passes no
launch_pdl to a user kernel inside a compiled graph (torch 2.11's codegen builds the kernel's
triton_meta without it), so with PDL the decode ops register as opaque custom ops (`op`) whose body
launches the kernel itself; without it, as triton_ops that inductor traces into. The choice is made
once, at import, because it decides how the ops register. The interpreter never runs the PDL path
(its launches take no launch_pdl). A kernel without PDL after one with it waits as any launch does;
one with PDL after one without (a cuBLAS GEMM, an inductor kernel) waits in griddepcontrol.wait for
that kernel's completion, so the order of memory effects is the stream's.
"""

from __future__ import annotations

import functools
import os

import torch

from lockstep.triton_support import interpreted, load_triton

ENABLED = os.environ.get("LOCKSTEP_PDL", "0") == "1"

triton = load_triton()
if triton is not None:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A PDL kernel's first step: wait until the previous grid has finished and its writes are
        visible, then let the next grid start launching (it waits the same way)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()


def op(name: str, mutates_args):
    """The decorator registering a decode op: torch.library.triton_op, or with PDL an opaque
    torch.library.custom_op (the module docstring says why)."""
    if ENABLED:
        return torch.library.custom_op(name, mutates_args=mutates_args)
    return torch.library.triton_op(name, mutates_args=mutates_args)


def launch(wrapped, grid):
    """wrap_triton(kernel)[grid] as an `op`'s body launches it, its PDL constexpr set: the kernel
    itself with launch_pdl where PDL is on (not under the interpreter), else as wrapped, PDL off.
    The call sites keep `torch.library.wrap_triton(kernel)` written out: triton_op finds an op's
    kernels by reading its source for that call (torch/_library/triton.py), and the AOTAutograd
    cache keys on their source."""
    if ENABLED and not interpreted():
        return functools.partial(getattr(wrapped, "kernel", wrapped)[grid], PDL=True, launch_pdl=True)
    return functools.partial(wrapped[grid], PDL=False)
