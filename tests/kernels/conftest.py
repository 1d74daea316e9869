"""Kernel tests run Triton's interpreter on a machine without a CUDA GPU.

The interpreter is chosen when a kernel is decorated, so this must run before the kernel modules
are imported; pytest loads this file before collecting the tests beside it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
