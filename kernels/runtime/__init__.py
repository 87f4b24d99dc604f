"""What every kernel family shares: launching, the compile cache, launch-geometry checks, vector
and half2 loads and stores, the wmma building blocks, and `voltserve check-kernels`."""

from voltserve.kernels.registry import KernelSpec, Op

OPS: tuple[Op, ...] = ()

KERNELS = (
    # wmma_ptx.py: the single-tile building block of wmma_ptx.cu (one warp's 16 x 16 product
    # through the linked vs_wmma_gemm16). Arguments: d [256] f32, a and b flat f16, k, b_col.
    KernelSpec(
        "runtime.wmma_ptx",
        "wmma_gemm16_kernel",
        ("void(float32[::1], float16[::1], float16[::1], int32, int32)",),
    ),
)
