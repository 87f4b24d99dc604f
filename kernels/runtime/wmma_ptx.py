"""The Python side of wmma_ptx.cu (Volta's wmma m16n16k16 instructions, f16 in, f32 accumulate,
as linked CUDA C++ device functions): its path, and the single-tile building block kernel that
the GPU tests (tests/gpu/test_wmma_ptx_gpu.py), the compile-cache tests and `voltserve
check-kernels` use to check that a numba kernel links the .cu and gets the tile product right.
The kernels that use wmma_ptx.cu for work (moe/wmma.py) link it themselves.

The CUDA simulator cannot run linked C++: under NUMBA_ENABLE_CUDASIM this module imports
without the kernel.
"""

from __future__ import annotations

from pathlib import Path

from numba import cuda
from numba.core.types import float16, float32
from voltserve.kernels.runtime.compile_cache import cached
from voltserve.kernels.runtime.numba_common import SIM

WMMA_CU = str(Path(__file__).with_name("wmma_ptx.cu"))
# CUDA C++ files the kernels of this module link; `voltserve check-kernels` compiles them too.
CUDA_SOURCES: tuple[str, ...] = (WMMA_CU,)

if not SIM:
    import cffi
    from numba import types

    ffi = cffi.FFI()
    _P16 = types.CPointer(types.float16)
    _P32 = types.CPointer(types.float32)

    # d[16,16] f32 = a[16,k] @ b (b row-major [k,16], or column-major when b_col != 0)
    wmma_gemm16 = cuda.declare_device(
        "vs_wmma_gemm16",
        types.int32(_P32, _P16, _P16, types.int32, types.int32),
        link=[WMMA_CU],
        abi="c",
    )

    @cached
    @cuda.jit
    def wmma_gemm16_kernel(d, a, b, k, b_col):
        """One warp: d[16, 16] f32 = a[16, k] f16 @ b via shared memory (b [k, 16] row-major, or
        b_col != 0: b given transposed as [16, k]). k <= 64, a multiple of 16."""
        a_s = cuda.shared.array(1024, float16, alignment=128)
        b_s = cuda.shared.array(1024, float16, alignment=128)
        d_s = cuda.shared.array(256, float32, alignment=128)
        tid = cuda.threadIdx.x
        for i in range(tid, 16 * k, 32):
            a_s[i] = a[i]
            b_s[i] = b[i]
        cuda.syncwarp()
        wmma_gemm16(ffi.from_buffer(d_s), ffi.from_buffer(a_s), ffi.from_buffer(b_s), k, b_col)
        cuda.syncwarp()
        for i in range(tid, 256, 32):
            d[i] = d_s[i]
