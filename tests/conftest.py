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

# The kernel cache (kernels/compile_cache.py) never touches the user's: every test session gets
# a fresh folder (subprocesses inherit it), removed at exit. VOLTSERVE_TEST_CACHE_DIR names a
# folder to keep instead (e.g. to rerun GPU tests without recompiling).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if os.environ.get("VOLTSERVE_TEST_CACHE_DIR"):
    os.environ["VOLTSERVE_CACHE_DIR"] = os.environ["VOLTSERVE_TEST_CACHE_DIR"]
else:
    _cache_dir = tempfile.mkdtemp(prefix="voltserve-test-cache-")
    os.environ["VOLTSERVE_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
