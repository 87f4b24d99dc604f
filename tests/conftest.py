"""Root test configuration, shared by every test folder.

Without a CUDA GPU, numba kernels run in numba's CUDA simulator. numba reads
NUMBA_ENABLE_CUDASIM once, when numba.cuda is first imported, so it is set here, before any test
module imports a kernel. torch is imported first to ask about the GPU (importing torch does not
import numba).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
