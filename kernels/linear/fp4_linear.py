"""Linear layers with FP4 weights (fp4_pack.py): y = x @ dequantize_fp4(w)^T (+ bias), what an FP4
quantization method's linear calls (through kernels/dispatch.fp4_linear).

Reference (CPU, VOLTSERVE_FORCE_REF=1, VOLTSERVE_QUANT_KERNELS=0): F.linear with the weight
dequantized in the run dtype. On CUDA (fp4_kernels.py): up to 8 rows the tiled GEMV, which
reads each code byte once (the gate_up projection with silu_and_mul in its epilogue; fp16 x in
its half2 form, fp4_kernels.form_for), for K a
multiple of 32 (`gemv_supports`: its 16-byte chunks); more rows, or K a multiple of 16 only,
dequantize the layer into the reused scratch buffer of the integer formats
(quant_linear.QuantScratch, reserved at load for the largest quantized linear) and hand it to
cuBLAS. Both launch on torch's current stream without host syncs (graph-capturable). Shapes or
alignments the kernels do not take run the reference (`fp4_gemv_cuda` called directly with
such a shape: the reference too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from voltserve.kernels.elementwise.activation import silu_and_mul_ref
from voltserve.kernels.linear.fp4_pack import Fp4Weight, dequantize_fp4
from voltserve.kernels.runtime.launch_geometry import fold_yz, on_gpu

DTYPES = (torch.float16, torch.float32)


def fp4_linear_ref(x: torch.Tensor, w: Fp4Weight, bias: torch.Tensor | None = None):
    return F.linear(x, dequantize_fp4(w, x.dtype), bias)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def code_words(w: Fp4Weight) -> torch.Tensor:
    """The codes as the kernels read them: int32 words [N, K / 8] (a view, no copy)."""
    return w.packed.view(torch.int32)


def gemv_supports(x: torch.Tensor, w: Fp4Weight) -> bool:
    """The GEMV takes x and w: 1..8 rows, and K a multiple of 32 so that a lane's 16-byte chunk
    of code words is whole and every row of words starts 16-byte aligned."""
    from voltserve.kernels.linear.fp4_kernels import MAX_M

    return (
        on_gpu(x)
        and on_gpu(w.packed)
        and x.dtype in DTYPES
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and x.shape[1] == w.in_features
        and x.stride(-1) == 1
        and _aligned(x)
        and w.in_features % 32 == 0
        and w.packed.is_contiguous()
        and w.packed.data_ptr() % 16 == 0
    )


def dequant_supports(w: Fp4Weight, out: torch.Tensor) -> bool:
    return (
        on_gpu(out)
        and on_gpu(w.packed)
        and out.dtype in DTYPES
        and tuple(out.shape) == w.shape
        and out.is_contiguous()
        and out.data_ptr() % 16 == 0
        and w.in_features % 8 == 0
    )


def fp4_dequant_grid(w: Fp4Weight, limit: int | None = None) -> tuple[int, int, int]:
    from voltserve.kernels.linear.fp4_kernels import THREADS

    per_row = -(-(w.in_features // 8) // THREADS)
    yz = fold_yz(w.out_features) if limit is None else fold_yz(w.out_features, limit)
    return (per_row, *yz)


def dequantize_into(w: Fp4Weight, out: torch.Tensor) -> torch.Tensor:
    """out[:] = dequantize_fp4(w) in out's dtype."""
    if not dequant_supports(w, out):
        return out.copy_(dequantize_fp4(w, out.dtype))
    from voltserve.kernels.linear.fp4_kernels import THREADS, fp4_dequant_kernel
    from voltserve.kernels.runtime.numba_common import current_stream, launch

    launch(
        fp4_dequant_kernel,
        fp4_dequant_grid(w),
        THREADS,
        (code_words(w), w.scales, w.gscale, out, w.group_shift, w.e8m0),
        current_stream(),
    )
    return out


def fp4_gate_up_ref(x: torch.Tensor, w: Fp4Weight, bias: torch.Tensor | None = None):
    return silu_and_mul_ref(fp4_linear_ref(x, w, bias))


def fp4_gemv_cuda(
    x: torch.Tensor,
    w: Fp4Weight,
    bias: torch.Tensor | None = None,
    gate_up: bool = False,
    tile: tuple[int, ...] | str | None = None,
    form: str | None = None,
):
    """x of 1..8 rows: one GEMV launch (the reference where gemv_supports says no); gate_up:
    silu_and_mul of the merged gate_up product, [M, N / 2]. tile: None for the default
    (fp4_kernels.tiling), (R, U) or (R, U, KS) to force one (benchmarks and tests), or
    fp4_kernels.V1 for the one-row-a-warp kernel (bench_quant_linear's comparison). form: None
    for fp4_kernels.form_for's choice (half2 for fp16 x, table for fp32), or a form to force
    (fp4_kernels.TABLE or HALF2; fp32 x stays TABLE); V1 has its own table decode."""
    if not gemv_supports(x, w) or (gate_up and w.out_features % 2):
        return (fp4_gate_up_ref if gate_up else fp4_linear_ref)(x, w, bias)
    from voltserve.kernels.linear import fp4_kernels as fk
    from voltserve.kernels.runtime.numba_common import current_stream, launch

    M = x.shape[0]
    cols = w.out_features // 2 if gate_up else w.out_features
    out = torch.empty((M, cols), dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    b = bias if has_bias else out[0]  # any 1-D array of the dtype; unread
    args = (x, code_words(w), w.scales, w.gscale, b, out, has_bias)
    if tile == fk.V1:
        kernel, grid = fk.fp4_gemv_v1_kernel(M, gate_up), fk.v1_grid(cols)
        args += (w.group_shift, w.e8m0)
    else:
        form = fk.form_for(M, x.dtype, form)
        kernel = fk.fp4_gemv_kernel(M, gate_up, w.group_size, w.e8m0, tile, form)
        grid = fk.grid_for(M, cols, gate_up, tile)
    launch(kernel, grid, fk.THREADS, args, current_stream())
    return out


def _cuda(ops, x: torch.Tensor) -> bool:
    return ops is not None and getattr(ops, "impl", {}).get("quant_linear") == "cuda" and x.is_cuda


def fp4_gate_up_silu(x: torch.Tensor, w: Fp4Weight, bias: torch.Tensor | None = None, ops=None):
    """silu_and_mul(x @ dequantize_fp4(w)^T (+ bias)) for a merged gate_up weight [2I, K]: decode
    rows on CUDA in one GEMV launch with the activation in its epilogue."""
    from voltserve.kernels.linear.fp4_kernels import MAX_M

    if w.out_features % 2:
        raise ValueError(f"gate_up weight needs an even number of rows, got {w.out_features}")
    if not _cuda(ops, x):
        return fp4_gate_up_ref(x, w, bias)
    if x.dim() == 2 and x.shape[0] <= MAX_M and gemv_supports(x, w):
        return fp4_gemv_cuda(x, w, bias, gate_up=True)
    return ops.silu_and_mul(fp4_linear(x, w, bias, ops))


def fp4_linear(x: torch.Tensor, w: Fp4Weight, bias: torch.Tensor | None = None, ops=None):
    """x [T, K] -> [T, N] in x's dtype. ops: the KernelDispatch (impl["quant_linear"] says cuda
    or ref, as for the integer formats); None: the reference."""
    from voltserve.kernels.linear.fp4_kernels import MAX_M
    from voltserve.kernels.linear.quant_linear import scratch_of

    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [T, {w.in_features}], got {tuple(x.shape)}")
    if not _cuda(ops, x):
        return fp4_linear_ref(x, w, bias)
    if x.shape[0] <= MAX_M and gemv_supports(x, w):
        return fp4_gemv_cuda(x, w, bias)
    scratch = scratch_of(ops)
    wd = scratch.get(w.out_features, w.in_features, x.dtype, x.device)
    dequantize_into(w, wd)
    return F.linear(x, wd, bias)


__all__ = [
    "fp4_linear",
    "fp4_linear_ref",
    "fp4_gate_up_silu",
    "fp4_gate_up_ref",
    "fp4_gemv_cuda",
    "dequantize_into",
    "fp4_dequant_grid",
    "gemv_supports",
    "dequant_supports",
]
