"""Session-wide test setup."""

import os

# Triton kernels run under the interpreter on machines without a GPU; the variable must be set
# before triton is first imported by any test module.
os.environ.setdefault("TRITON_INTERPRET", "1")
