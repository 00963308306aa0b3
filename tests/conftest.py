"""Session-wide test setup."""

import os

# Triton kernels run under the interpreter on machines without a GPU; the variable must be set
# before triton is first imported by any test module. A GPU run (LOCKSTEP_TEST_DEVICE=cuda or
# cuda-shared) compiles them: interpreted kernels cannot be traced by torch.compile (wrap_triton
# refuses them) and would test the interpreter, not the GPU code.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("LOCKSTEP_TEST_DEVICE", "cpu").startswith("cuda")
                      else "1")

import torch  # noqa: E402

# The test models are tiny: a second thread buys nothing and, on a busy 2-core machine, OpenMP
# threads spinning against each other made single steps up to 100x slower.
torch.set_num_threads(1)
