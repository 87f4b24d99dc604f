"""FP4 weights (fp4_pack.py) on CUDA cores, cc 7.0 feature set (no FP4 or FP8 instructions: fp16
storage, fp32 arithmetic): the codes and scale bytes are decoded in software.

- E2M1 codes: a 16-entry fp32 table in shared memory (sign included), filled by the block's
  first 16 threads before a barrier. The kernels read the code bytes as int32 words (the
  launchers pass an int32 view of fp4_pack's uint8 [N, K / 2]: little-endian, so input k + e
  of a word's 8 sits at bits 4e .. 4e + 3 with the low nibble first), a shift and a mask per
  table index.
- Scale bytes (`scale_f32`): E4M3 by building the fp32 bit pattern (exponent + 120, mantissa
  moved up 20 bits; the subnormal exponent 0 as (1 + m / 8) * 2**-6 - 2**-6, exact), E8M0 as the
  exponent field itself (byte 0: 2**-127, the fp32 subnormal 0x00400000). NaN bytes never reach
  a kernel (the loader refuses them, fp4_pack.check_scale_bytes).

Kernels:

- `fp4_dequant_kernel`: the weight into an [N, K] buffer of the run dtype (the path above the
  GEMV's rows: then cuBLAS). One thread per 8 inputs (one code word, one block since blocks are
  16 or 32 wide), one 16-byte store (vec_io.st8); grid (K / 8 / THREADS blocks, rows folded over y and
  z as quant_dequant does). Each value is e2m1 * (scale * gscale[row]) in fp32, rounded once:
  fp4_pack.dequantize_fp4's rule exactly.
- `fp4_gemv_kernel(M)`: y[M, N] = x[M, K] @ w^T (+ bias) for 1..8 rows, built per row variant
  (1, 2, 4, 8) with M a compile-time constant. One warp per output row, blocks of 4 warps as
  quant_gemv's; a lane takes 16 inputs (two code words, one block) per step, 32 lanes 512 inputs,
  reads each x row in two 16-byte loads (vec_io.ld8) and sums the 16 products of each row in
  fp32 before one multiply by the block's scale (the factored form of quant_gemv: the products
  are exact, only the fp32 sums are regrouped against the reference). Lane sums are reduced
  with warp shuffles (gemv._warp_sum) and lane 0 writes the row, bias added in fp32, one
  rounding. A block's rows past N compute row N - 1 and write nothing (every lane of the block
  reaches the same shuffles, which the simulator's stand-in needs).

  The decode step (`decode_chunk`: a lane's 16 codes and its block's scale; `dot_chunk`: their
  products with 16 inputs of an x row) is shared with the fused FP4 MoE experts
  (moe/fp4_decode.py).

- `fp4_gemv_kernel(M, gate_up=True)`: the merged gate_up weight [2I, K], a warp on gate row j
  and up row I + j, writing silu_and_mul's h[m, j] with quant_gemv's epilogue (each sum
  rounded as the linear stores it, then activation._silu_mul).

Not here: quant_gemv's qkv + rotary epilogue and its half2 and split-K forms (an FP4 qkv
projection runs the GEMV, then rotary_and_cache).
"""

from __future__ import annotations

from numba import cuda, uint32
from voltserve.kernels.elementwise.activation import _silu_mul
from voltserve.kernels.linear.gemv import _warp_sum
from voltserve.kernels.linear.quant_common import bits_f32
from voltserve.kernels.runtime.numba_common import float32, named_kernel, round_like
from voltserve.kernels.runtime.vec_io import ld8, st8

WARPS = 4
THREADS = 32 * WARPS
CHUNK = 16  # inputs a lane reads per step (two code words)
VARIANTS = (1, 2, 4, 8)
MAX_M = VARIANTS[-1]
SUBNORMAL_E4M3 = 0.015625  # 2**-6: the E4M3 subnormal's offset in scale_f32


@cuda.jit(device=True, inline="always")
def e2m1_value(c):
    """The E2M1 value of 4-bit code c (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    m = c & 7
    if m < 4:
        v = float32(m) * float32(0.5)
    elif m < 6:
        v = float32(m - 2)
    else:
        v = float32(2 * m - 8)
    return -v if c & 8 else v


@cuda.jit(device=True, inline="always")
def scale_f32(b, e8m0):
    """A scale byte as fp32: E8M0 (2**(b - 127)) or E4M3 (sign, exponent bias 7, 3 mantissa
    bits, exponent 0 subnormal)."""
    u = uint32(b)
    if e8m0:
        return bits_f32(u << 23) if u != 0 else bits_f32(0x00400000)
    e = (u >> 3) & 15
    m = (u & 7) << 20
    if e == 0:
        v = bits_f32((121 << 23) | m) - float32(SUBNORMAL_E4M3)
    else:
        v = bits_f32(((e + 120) << 23) | m)
    return -v if u & 0x80 else v


@cuda.jit(device=True, inline="always")
def fill_table(tab):
    t = cuda.threadIdx.x
    if t < 16:
        tab[t] = e2m1_value(t)
    cuda.syncthreads()


def fp4_dequant_kernel(packed, scales, gscale, out, gshift, e8m0):
    tab = cuda.shared.array(16, float32)
    fill_table(tab)
    row = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y  # launch_geometry.fold_yz
    k = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * 8
    if k >= out.shape[1] or row >= out.shape[0]:
        return
    s = scale_f32(scales[row, k >> gshift], e8m0) * gscale[row]
    u = packed[row, k >> 3]  # inputs k .. k + 7, input k + e in bits 4e .. 4e + 3
    st8(
        out,
        (row, k),
        (
            tab[u & 15] * s,
            tab[(u >> 4) & 15] * s,
            tab[(u >> 8) & 15] * s,
            tab[(u >> 12) & 15] * s,
            tab[(u >> 16) & 15] * s,
            tab[(u >> 20) & 15] * s,
            tab[(u >> 24) & 15] * s,
            tab[(u >> 28) & 15] * s,
        ),
    )


fp4_dequant_kernel = cuda.jit(fp4_dequant_kernel)


@cuda.jit(device=True, inline="always")
def decode_chunk(tab, packed, scales, r, k, gshift, e8m0, g):
    """The decode step: inputs k .. k + 15 of weight row r (two code words, one block) as their
    16 E2M1 values (fp32, from the shared table `tab`) and the block's scale times g (the row's
    global scale; the MoE down projection folds its routing weight in too)."""
    s = scale_f32(scales[r, k >> gshift], e8m0) * g
    u0 = packed[r, k >> 3]  # inputs k .. k + 7 (input k + e at bits 4e)
    u1 = packed[r, (k >> 3) + 1]  # inputs k + 8 .. k + 15
    w = (
        tab[u0 & 15],
        tab[(u0 >> 4) & 15],
        tab[(u0 >> 8) & 15],
        tab[(u0 >> 12) & 15],
        tab[(u0 >> 16) & 15],
        tab[(u0 >> 20) & 15],
        tab[(u0 >> 24) & 15],
        tab[(u0 >> 28) & 15],
        tab[u1 & 15],
        tab[(u1 >> 4) & 15],
        tab[(u1 >> 8) & 15],
        tab[(u1 >> 12) & 15],
        tab[(u1 >> 16) & 15],
        tab[(u1 >> 20) & 15],
        tab[(u1 >> 24) & 15],
        tab[(u1 >> 28) & 15],
    )
    return w, s


@cuda.jit(device=True, inline="always")
def dot_chunk(w, x, m, k):
    """The 16 products of decode_chunk's values with x[m, k .. k + 15] (two 16-byte loads),
    summed in fp32 before the caller's one multiply by the block's scale."""
    a = ld8(x, (m, k))
    b = ld8(x, (m, k + 8))
    d = w[0] * a[0] + w[1] * a[1] + w[2] * a[2] + w[3] * a[3]
    d += w[4] * a[4] + w[5] * a[5] + w[6] * a[6] + w[7] * a[7]
    d += w[8] * b[0] + w[9] * b[1] + w[10] * b[2] + w[11] * b[3]
    d += w[12] * b[4] + w[13] * b[5] + w[14] * b[6] + w[15] * b[7]
    return d


def _make_gemv(M: int, gate_up: bool):
    RW = 2 if gate_up else 1  # weight rows per warp: (gate j, up N / 2 + j) or one row

    def kernel(x, packed, scales, gscale, bias, out, has_bias, gshift, e8m0):
        tab = cuda.shared.array(16, float32)
        fill_table(tab)
        lane = cuda.threadIdx.x & 31
        N = packed.shape[0] // RW  # output columns
        col = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
        live = col < N
        c = col if live else N - 1
        K = x.shape[1]
        Mx = x.shape[0]
        acc = cuda.local.array((RW, M), float32)
        for i in range(RW):
            for m in range(M):
                acc[i, m] = float32(0.0)
        for i in range(RW):
            r = c + i * N
            g = gscale[r]
            for k in range(lane * CHUNK, K, 32 * CHUNK):
                w, s = decode_chunk(tab, packed, scales, r, k, gshift, e8m0, g)
                for m in range(M):
                    if m < Mx:
                        acc[i, m] += dot_chunk(w, x, m, k) * s
        for m in range(M):
            v = _warp_sum(acc[0, m])
            u = v
            if RW == 2:
                u = _warp_sum(acc[1, m])
            if lane == 0 and live and m < Mx:
                if has_bias:
                    v += float32(bias[c])
                    if RW == 2:
                        u += float32(bias[c + N])
                if RW == 2:
                    # as the linear stores gate and up, then as silu_and_mul rounds h
                    out[m, c] = _silu_mul(round_like(v, out), round_like(u, out), out)
                else:
                    out[m, c] = v

    name = f"fp4_gemv_{'gate_up_' if gate_up else ''}kernel_m{M}"
    return cuda.jit(named_kernel(kernel, __name__, name))


_GEMV: dict[tuple[int, bool], object] = {}


def variant_for(m: int) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"FP4 gemv kernels cover M = 1..{MAX_M}, got {m}")
    return next(v for v in VARIANTS if v >= m)


def fp4_gemv_kernel(m: int, gate_up: bool = False):
    """The kernel serving m input rows (its variant's), built once per variant and kind."""
    key = (variant_for(m), gate_up)
    k = _GEMV.get(key)
    if k is None:
        k = _GEMV[key] = _make_gemv(*key)
    return k


def gemv_grid(n: int) -> int:
    return -(-n // WARPS)


# Representative instances for `voltserve check-kernels` (kernels/registry.py).
fp4_gemv_kernel_m1 = fp4_gemv_kernel(1)
fp4_gemv_kernel_m8 = fp4_gemv_kernel(8)
fp4_gemv_gate_up_kernel_m1 = fp4_gemv_kernel(1, gate_up=True)

__all__ = [
    "decode_chunk",
    "dot_chunk",
    "fill_table",
    "fp4_dequant_kernel",
    "fp4_gemv_kernel",
    "gemv_grid",
    "scale_f32",
    "e2m1_value",
    "variant_for",
]
