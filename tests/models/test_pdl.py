"""models/layers/pdl.py with LOCKSTEP_PDL=1: the decode ops register as opaque custom ops whose
bodies launch the kernels themselves; under the interpreter (these CPU tests) with PDL off in the
launch, so the kernel tests of those ops pass unchanged in a process started with the switch on.
The GPU side (the kernels' griddepcontrol.wait) is test_kernels_compile_for_gpu.py's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.models.layers import pdl

TESTS = Path(__file__).parent
# whether PDL is on, and whether torch.compile traces into the op (a triton_op decomposes under
# FunctionalTensorMode into its kernels; an opaque custom op does not)
PROBE = ("from torch._subclasses.functional_tensor import FunctionalTensorMode as F; "
         "from lockstep.models.layers import hc_pre_triton as h, pdl; "
         "print(pdl.ENABLED, F in h.hc_pre_step._torch_dispatch_fns)")


@pytest.mark.skipif(pdl.triton is None, reason="triton is not installed")
def test_with_pdl_the_decode_ops_are_custom_ops_and_their_kernel_tests_pass():
    env = {**os.environ, "LOCKSTEP_PDL": "1", "OMP_NUM_THREADS": "1"}
    for switch, traced_into in (("1", "False"), ("0", "True")):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                             env={**env, "LOCKSTEP_PDL": switch})
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [str(switch == "1"), traced_into]
    files = [str(TESTS / f) for f in ("test_hc_pre_triton.py", "test_output_a_triton.py")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
                          *files], capture_output=True, text=True, env=env, timeout=900, cwd=TESTS.parent.parent)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout.splitlines()[-1]
