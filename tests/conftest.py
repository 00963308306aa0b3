"""Session-wide test setup."""

import os

# Triton kernels run under the interpreter on machines without a GPU; the variable must be set
# before triton is first imported by any test module.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# The test models are tiny: a second thread buys nothing and, on a busy 2-core machine, OpenMP
# threads spinning against each other made single steps up to 100x slower.
torch.set_num_threads(1)
