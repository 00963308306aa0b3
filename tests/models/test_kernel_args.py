"""No Triton kernel of lockstep's takes a default argument. Inductor's launcher for a kernel inside a
compiled graph (torch.library.wrap_triton, torch 2.11 on the GPU image) passes only the arguments
named at the launch, so a launch leaning on a default compiles and then fails at its first call
("launcher() missing ... required positional arguments"): on the H200 the compiled decode step did,
for lockstep::closing_entry's write switches. The interpreter, which the other kernel tests run,
fills defaults in, so this is the check that runs on the CPU."""

import importlib
import inspect
import pkgutil

import pytest

import lockstep
from lockstep.models.layers import grouped_gemm_triton as gt

triton = gt.triton


def _kernels():
    """(module, name, kernel) for every Triton kernel or helper defined in a lockstep module."""
    for info in pkgutil.walk_packages(lockstep.__path__, "lockstep."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.KernelInterface) and obj.fn.__module__ == info.name:
                yield info.name, name, obj


def _defaults(kernel) -> list[str]:
    return [p.name for p in inspect.signature(kernel.fn).parameters.values() if p.default is not p.empty]


@pytest.mark.skipif(triton is None, reason="triton is not installed")
def test_no_kernel_takes_a_default_argument():
    kernels = list(_kernels())
    assert len(kernels) > 100, "the kernel modules were found"  # 109 at the time of writing
    with_defaults = [f"{module}.{name}: {_defaults(k)}" for module, name, k in kernels if _defaults(k)]
    assert not with_defaults, "\n".join(with_defaults)
