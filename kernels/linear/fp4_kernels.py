"""FP4 weights (fp4_pack.py) on CUDA cores, cc 7.0 feature set (no FP4 or FP8 instructions: fp16
storage, fp32 and f16x2 arithmetic): the codes and scale bytes are decoded in software.

- E2M1 codes, for fp32 arithmetic (the dequantize kernel, the GEMV's table form, the MoE
  experts): a 16-entry fp32 table in shared memory (sign included), filled by the block's
  first 16 threads before a barrier. The kernels read the code bytes as int32 words (the
  launchers pass an int32 view of fp4_pack's uint8 [N, K / 2]: little-endian, so input k + e
  of a word's 8 sits at bits 4e .. 4e + 3 with the low nibble first), a shift and a mask per
  table index. Why a table and not a register decode: the fp32 pattern
  ((c & 7) << 22) | ((c & 8) << 28) is the code's value times 2**-126, exact, subnormals
  included, but it costs two shifts and two logic ops a code (magnitude and sign move by
  different distances) and an x scaled by a power of two so that the products stay normal;
  the table costs a shift, an AND and one LDS. Its 16 words sit in 16 banks, so a warp's
  lookup is one shared-memory wavefront whatever the codes (32 codes a clock an SM, at or
  above the code rate the copy bandwidth delivers on an H100 or H200), and it keeps the
  integer pipe, which Hopper runs at half the FP32 rate, at two ops a code. For f16x2
  arithmetic (the GEMV's half2 form) the codes are decoded in registers, two a half2: see
  the GEMV's forms below.
- Scale bytes (`scale_f32`): E4M3 by moving its bits into fp32's (exponent and mantissa 20
  bits up, sign to bit 31): the fp32 pattern is the value times 2**-120 for every byte, the
  subnormal exponent 0 included (fp32's exponent 0 is subnormal too, with the same linear
  mantissa), and one multiply by 2**120 is exact (a power of two, the result normal); E8M0 as
  the exponent field itself (byte 0: 2**-127, the fp32 subnormal 0x00400000, which max() picks
  since every other byte gives a larger pattern). NaN bytes never reach a kernel (the loader
  refuses them, fp4_pack.check_scale_bytes). No flush to zero: the kernels are built without
  fastmath.

Kernels:

- `fp4_dequant_kernel`: the weight into an [N, K] buffer of the run dtype (the path above the
  GEMV's rows: then cuBLAS). One thread per 8 inputs (one code word, one block since blocks are
  16 or 32 wide), one 16-byte store (vec_io.st8); grid (K / 8 / THREADS blocks, rows folded over y and
  z as quant_dequant does). Each value is e2m1 * (scale * gscale[row]) in fp32, rounded once:
  fp4_pack.dequantize_fp4's rule exactly.
- `fp4_gemv_kernel(M, gate_up, group, e8m0, tile, form)`: y[M, N] = x[M, K] @ w^T (+ bias)
  for 1..8 rows, generated per configuration (`_source`) with the memory-level parallelism of
  the int4 GEMV (quant_gemv.py):

  - one warp owns R weight rows (plain: R output rows; gate_up: R / 2 columns, each its gate row
    j and up row N + j) for the M inputs; a lane reads 16-byte chunks of a row's code words (4
    words: 32 inputs, two NVFP4 blocks or one MXFP4 block), U chunks per step, and issues the
    step's R * U code loads and R * U * (32 / group) scale-byte loads before the first decode;
  - per block and (row, input) the 16 or 32 products of E2M1 values and x (read next to its
    use in 16-byte loads and shared by the R rows) are summed, then multiplied once by the
    block's scale times the row's global scale (in fp32, rounded as dequantize_fp4 rounds it)
    and added to the fp32 accumulator, in one of two forms (below);
  - split-K (the tile's KS, quant_gemv's scheme): the KS consecutive warps of a block share one
    group of rows, warp p walking the p-th share of K, cut at whole warp chunks (128 words, every
    lane one 16-byte chunk); after the loop warps 1..KS-1 put their lane sums in shared memory
    and leave after a barrier, and warp 0 adds them in warp order (the same sum every run);
  - lane partial sums are reduced with warp shuffles (gemv._warp_sum); lane m * R + r writes
    output (m, row0 + r), bias added in fp32, one rounding. gate_up writes silu_and_mul's h with
    quant_gemv's epilogue (each sum rounded as the linear stores it, then
    activation._silu_mul).

  Tiles (`tiling`): int4's choices, whose chunks are the same 16 bytes of 32 codes: (R, U, KS)
  = (4, 1, 2) at one row (SPLIT_K_M1: the short linears are latency-bound, and two warps on
  each group halve the serial walk along K), (4, 2, 1) at 2 rows (gate_up: (4, 1, 1)),
  (4, 1, 1) at 3-4 rows, (2, 2, 1) at 5-8 rows (the 8-input accumulators). Not yet measured for
  FP4: `tile` overrides them for benchmarks and tests.

  Guards: K a multiple of 32 (fp4_linear.gemv_supports; whole 16-byte chunks, and rows of code
  words that stay 16-byte aligned). A chunk past the end of K (or of the warp's share) loads
  zero codes, its block index is clamped to the row's last block and its x is read at the
  weight's last chunk (in bounds, no per-value zero fill), so it adds 0 * x: one guarded body
  serves full and partial steps. (An x with an inf or NaN anywhere makes every output of the
  reference inf or NaN already.) Rows past N (a partial last group) read row N - 1 and write
  nothing; every warp walks its K and reaches the same shuffles (which the simulator's
  stand-in needs).

  M, R, U, KS, the block size, the scale kind and the form are compile-time constants of a
  generated kernel (built on first use), so accumulators and in-flight words stay in
  registers and only the weight's scale decode is compiled.

  Dot-product forms (`form_for` picks one per launch, fp4_linear.fp4_gemv_cuda's `form`
  forces one for benchmarks and tests):

  - TABLE (fp32 x; fp16 x when forced): E2M1 values from the table, x widened to fp32, the
    block's products summed in fp32 (exact for fp16 x: 2 significant bits times 11; the sums
    regrouped against the reference in fp32 only). SASS of the NVFP4 kernel at one row
    ((4, 1, 2); its cc 7.0 PTX assembled for sm_90, as an H100 compiles it at load): 731
    instructions a step of 128 weights, 5.7 a weight: 128 LDS and 128 FFMA, ~250 shifts and
    ANDs making table indices, 32 x conversions, the rest scale decode, addresses and
    guards; 96 registers there (sm_70: 100), no spills.
  - HALF2 (fp16 x at 1-8 rows, the default there; `_step_half2`): two codes an instruction,
    as quant_gemv's half2 form. Decode (`h2_decode`): the fp16 pattern
    (mag << 9) | (sign << 15) of a code (magnitude bits e1 e0 m, sign bit 3) is exactly its
    E2M1 value times 2**-14 (exponent field e1 e0, top mantissa bit m; e1 e0 = 0 gives the
    fp16 subnormals 0 and 0.5 * 2**-14), and codes e and e + 4 of a word sit 16 bits apart,
    as a half2's halves do. Magnitude and sign move by different distances (3 bits apart in
    the code, 6 in the half), so a word is first split into its odd codes (bits 4-7 of each
    byte) and even codes (bits 0-3), each in "byte form", magnitude at bits 1-3 and sign at
    bit 7: od = ((w >> 3) & 0x0E0E0E0E) | (w & 0x80808080) (one shift, two LOP3s) and
    ev = ((w << 1) & 0x0E0E0E0E) | ((w << 4) & 0x80808080) (two shifts, two LOP3s); then
    each pair is one instruction: prmt(ev, 0, 0x2404) = (code 0, code 4) (bytes 0 and 2
    moved up to bytes 1 and 3, zero bytes below), ev & 0xFF00FF00 = (2, 6), and (1, 5),
    (3, 7) likewise from od. One mul.f16x2 by 2**(14 - s) per pair makes the exact values
    v * 2**-s (normal fp16: |v| * 2**-s >= 2**-8; multiplying the products by 2**-14
    instead would put them among the fp16 subnormals). The 16-byte x load is the half2 pairs
    (x0, x1) .. (x6, x7); the pairs (x_e, x_e+4) that meet the code pairs are four prmt a
    word and x row (high or low halves of two words), shared by the R rows. Where that
    costs more than regrouping the codes (`h2_gap`: 5 R < 4 M, the 8-row tile's R = 2) the
    code word is regrouped instead (nibbles 1 <-> 2 and 5 <-> 6 swapped with two shifts
    and two LOP3s, then one prmt to bytes (0, 2, 1, 3): even codes in the low half, odd in
    the high) and the same decode gives the pairs (2e, 2e + 1) of the x load. Then one
    fma.f16x2 per code pair and x row adds two products to the block's fp16 run, one run
    per (block, row, input) with group / 2 products a half; at the block's end the run's
    halves are widened to fp32 (two cvt) and multiplied by the block's fp32 factor into
    the accumulator (two FFMAs), which is multiplied by 2**s after the loop (exact).
    PTX of the loop of the NVFP4 kernel at one row ((4, 1, 2), cc 7.0, check-kernels'
    NVVM; counted as quant_gemv counts: address, guard and load instructions and register
    moves left out, AND + OR as one LOP3): 400 instructions a step of 128 weights, 3.1 a
    weight: 1.0 f16x2 (0.5 decoding multiplies, 0.5 FMAs), 0.75 LOP3, 0.375 shifts and
    0.25 prmt decoding, 0.125 prmt for x, 0.25 widening and folding, 0.375 scale decode
    (shifts, LOP3s and two FMULs a block and row); 80 registers for sm_70 (table 100), no
    shared table (the 2 KB are split-K's). SASS for sm_90, as above: 517 instructions a
    step, 4.0 a weight (table 731, 5.7; quant_gemv's int4 half2 at one row, 466 a step of
    as many weights, 3.6), 72 registers. MXFP4 at one row: 441 (table 668), 80 registers
    (96); 2 rows ((4, 2, 1), 256 weights a step): 1297 (table 1837), 96 registers for
    sm_70 (128); 4 rows: 901 (1288), 128 (130); 8 rows ((2, 2, 1), codes regrouped): 1506
    (2500; x regrouped instead: 1665), 141 (176). On an H100 the Llama-3-8B linears at one row
    reach 0.61 (NVFP4) and 0.67 (MXFP4) of their bytes floor, against 0.54 and 0.57 for the
    table form (BENCHMARKS.md §19).

    Precision (fp16 only inside a run; quant_gemv's argument): codes, the decoded v * 2**-s
    and x are exact, and each of a run's n = group / 2 roundings (its first product, then
    n - 1 fma.f16x2) is within 2**-11 of its result in fp16's normal range, or 2**-25
    absolute where the result is an fp16 subnormal. In output units (times 2**s |S|, S the
    block's fp32 factor), against the exact sum with the reference's weights and besides
    the table form's fp32 roundings (~2**-24 of sum |x w| each):

        |y - y_exact| <= gamma_n * sum_k |x_k w_k| + 2 n 2**-25 (1 + gamma_n) 2**s sum_b |S_b|

    gamma_n = n 2**-11 / (1 - n 2**-11), the sum over the row's blocks b: for NVFP4
    (n = 8, s = 6) about 2**-8 sum |x w| + 2**-15 sum_b |S_b|, for MXFP4 (n = 16, s = 7)
    about 2**-7 sum |x w| + 2**-13 sum_b |S_b|. The first term is the worst case of n
    same-signed roundings per run; random ones average out: in simulator runs (K = 4096,
    x ~ N(0, 1), fp32 outputs to see the sums alone) the error is 2.6e-4 (NVFP4) and 6.5e-4
    (MXFP4) of max |y|, 2e-5 and 5e-5 of sum |x w|, one to a few fp16 ulps of the output
    (the table form: ~1e-7). The second term is the subnormal loss of small products: with
    |x| ~ 1e-3 everywhere the runs are subnormal, 6e-4 and 8.5e-4 of max |y|. Range: a run
    is at most (group / 2) * 6 * 65504 * 2**-s = 0.75 * 65504 (the 2**-s, 2**-6 for blocks
    of 16 and 2**-7 for 32, is what keeps it there), so no fp16 x overflows a run; the
    f16x2 instructions are `.rn` without `.ftz` (kernels/runtime/half2.py).

- `fp4_gemv_v1_kernel(M)`: one warp a row, a lane two code words (16 inputs, one block) a step,
  8 bytes in flight; kept so that bench_quant_linear can time it beside the tiled kernel (tile
  `V1` of fp4_linear.fp4_gemv_cuda). Its decode step (`decode_chunk`: a lane's 16 codes and
  its block's scale; `dot_chunk`: their products with 16 inputs of an x row) is shared with the
  fused FP4 MoE experts (moe/fp4_decode.py).

Not here: quant_gemv's qkv + rotary epilogue (an FP4 qkv projection runs the GEMV, then
rotary_and_cache).
"""

from __future__ import annotations

import torch
from numba import cuda, uint32
from voltserve.kernels.elementwise.activation import _silu_mul
from voltserve.kernels.linear.gemv import _warp_sum
from voltserve.kernels.linear.quant_common import ZERO_W4, bits_f32, ld_w4
from voltserve.kernels.linear.quant_gemv import gate_up_epilogue, plain_epilogue, split_k_sum
from voltserve.kernels.runtime.compile_cache import cached_factory
from voltserve.kernels.runtime.half2 import h2_bits, h2f, h2fma, h2mul, ldh8, prmt, prmt2
from voltserve.kernels.runtime.numba_common import float32, named_kernel, nvvm_inlined, round_like
from voltserve.kernels.runtime.vec_io import ld1, ld8, st8

WARPS = 4
THREADS = 32 * WARPS
CHUNK = 16  # inputs a lane reads per step in decode_chunk (two code words)
VARIANTS = (1, 2, 4, 8)
MAX_M = VARIANTS[-1]
E4M3_UNIT = 2.0**120  # scale_f32: an E4M3 byte's bits in fp32's are its value times 2**-120
E8M0_MIN_BITS = 0x00400000  # 2**-127, E8M0 byte 0, as an fp32 (subnormal) pattern
WORDS = 4  # code words a lane reads per chunk of the tiled GEMV: one 16-byte load, 32 inputs
WARP_WORDS = 32 * WORDS  # code words of a warp chunk (every lane one chunk): 1024 inputs
KS_CHOICES = (1, 2, 4)  # split-K: warps of a block on one group of rows
# The default at one row (plain and gate_up): quant_gemv.SPLIT_K_M1, the int4 choice.
SPLIT_K_M1 = (4, 1, 2)
V1 = "v1"  # fp4_linear.fp4_gemv_cuda's tile for fp4_gemv_v1_kernel
# Dot-product forms of the tiled GEMV (`form_for`): E2M1 values from the shared fp32 table and
# fp32 FMAs, or fp16 pairs (fp16 x only).
TABLE, HALF2 = "table", "half2"
FORMS = (TABLE, HALF2)
Tile = tuple[int, int] | tuple[int, int, int] | None  # (R, U) or (R, U, KS); None: the default


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
    bits, exponent 0 subnormal); see the module doc."""
    u = uint32(b)
    if e8m0:
        return bits_f32(max(u << 23, uint32(E8M0_MIN_BITS)))
    return bits_f32(((u & 0x7F) << 20) | ((u & 0x80) << 24)) * float32(E4M3_UNIT)


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


def _make_gemv_v1(M: int, gate_up: bool):
    """fp4_gemv_v1_kernel's kernel: one output row (gate_up: column) per warp, a lane one
    decode_chunk per step; arguments as the tiled kernel's, then group_shift and e8m0."""
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

    name = f"fp4_gemv_v1_{'gate_up_' if gate_up else ''}kernel_m{M}"
    return cuda.jit(named_kernel(kernel, __name__, name))


_GEMV_V1: dict[tuple[int, bool], object] = {}


def fp4_gemv_v1_kernel(m: int, gate_up: bool = False):
    """The one-row-a-warp kernel for m input rows (its variant's), built once per variant."""
    key = (variant_for(m), gate_up)
    k = _GEMV_V1.get(key)
    if k is None:
        k = _GEMV_V1[key] = _make_gemv_v1(*key)
    return k


def v1_grid(n: int) -> int:
    return -(-n // WARPS)


# ---------------------------------------------------------------------------------------------
# The tiled GEMV: source written out per configuration (see the module doc)


def variant_for(m: int) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"FP4 gemv kernels cover M = 1..{MAX_M}, got {m}")
    return next(v for v in VARIANTS if v >= m)


def tile_for(m: int, gate_up: bool = False) -> tuple[int, int]:
    """(R weight rows per warp, U chunks per lane per step) of the M = m variant at KS = 1:
    quant_gemv.tile_for's int4 choices (same 16-byte chunks of 32 codes). R = 4 shares each x
    element a lane widens among four rows; M = 8 takes R = 2 for its 8 x R accumulators and
    partial sums; U = 2 keeps 128 bytes a lane in flight where R * M leaves registers for it."""
    if m == 8:
        return (2, 2)
    return (4, 1) if gate_up or m == 4 else (4, 2)


def tiling(m: int, gate_up: bool = False, tile: Tile = None) -> tuple[int, int, int]:
    """(R, U, KS) of a launch for m rows: tile (R, U) or (R, U, KS) when given, else
    SPLIT_K_M1 at one row and tile_for's (R, U) with KS = 1 above."""
    v = variant_for(m)
    if tile is None:
        return SPLIT_K_M1 if v == 1 else (*tile_for(v, gate_up), 1)
    R, U, KS = (*tile, 1) if len(tile) == 2 else tile
    if KS not in KS_CHOICES:
        raise ValueError(f"split-K over {KS} warps: KS must be one of {KS_CHOICES}")
    if R < 1 or U < 1 or (gate_up and R % 2):
        raise ValueError(f"tile {tile}: R, U >= 1 (gate_up pairs rows: R even)")
    if v * (R // 2 if gate_up else R) > 32:
        raise ValueError(f"tile {tile}: {v} rows x R outputs must fit the 32 lanes")
    return R, U, KS


def form_for(m: int, dtype: torch.dtype, force: str | None = None) -> str:
    """The dot-product form of the launch for m rows of x in `dtype` (the one place the choice
    is made): TABLE for fp32 x (HALF2 reads x as fp16 pairs), HALF2 for fp16 x at every m the
    GEMV takes (1..MAX_M; others are refused). force: a form for benchmarks and tests (fp32 x
    stays TABLE)."""
    variant_for(m)
    if force is not None and force not in FORMS:
        raise ValueError(f"unknown FP4 dot-product form {force!r} (one of {FORMS})")
    if dtype != torch.float16:
        return TABLE
    return force or HALF2


def grid_for(m: int, cols: int, gate_up: bool = False, tile: Tile = None) -> int:
    """Blocks for `cols` output columns: WARPS / KS groups of R rows (gate_up: R / 2 columns)."""
    R, _, KS = tiling(m, gate_up, tile)
    per_block = WARPS // KS * (R // 2 if gate_up else R)
    return -(-cols // per_block)


def scheme_name(group: int, e8m0: bool) -> str:
    """nvfp4 (E4M3 per 16), mxfp4 (E8M0 per 32), else the block size and the scale kind."""
    if (group, e8m0) == (16, False):
        return "nvfp4"
    if (group, e8m0) == (32, True):
        return "mxfp4"
    return f"g{group}_{'e8m0' if e8m0 else 'e4m3'}"


def _rows(R: int, gate_up: bool) -> list[str]:
    """The warp's weight rows rw0..rw{R-1}, clamped to the last row (rows past N compute that
    row and write nothing), and their global scales."""
    if gate_up:
        L = ["    N = qw.shape[0] >> 1", f"    row0 = grp * {R // 2}"]
        for q in range(R // 2):
            L += [f"    rw{2 * q} = min(row0 + {q}, N - 1)", f"    rw{2 * q + 1} = rw{2 * q} + N"]
    else:
        L = ["    N = qw.shape[0]", f"    row0 = grp * {R}"]
        L += [f"    rw{r} = min(row0 + {r}, N - 1)" for r in range(R)]
    return L + [f"    gs{r} = gscale[rw{r}]" for r in range(R)]


def _k_range(ks: int) -> list[str]:
    """w0 and W, the warp's range of code words. ks > 1: warp `part` of its group takes the
    part-th share, ceil(warp chunks / ks) whole warp chunks (the last share shorter or empty),
    so the step's guards (c < W) cut each share's end as they cut the weight's."""
    if ks == 1:
        return ["    w0 = 0", "    W = qw.shape[1]"]
    return [
        f"    part = (cuda.threadIdx.x >> 5) & {ks - 1}",
        "    Wt = qw.shape[1]",
        f"    span = ((Wt + {WARP_WORDS * ks - 1}) // {WARP_WORDS * ks}) * {WARP_WORDS}",
        "    w0 = part * span",
        "    W = min(w0 + span, Wt)",
    ]


def _step_loads(ind: str, R: int, U: int, blocks: int, e8m0: bool) -> list[str]:
    """The start of a warp step (both forms): lane chunks c{j} = w0 + 4 * lane + 128 * j of rows
    rw{r}, every code and scale-byte load first (codes past W zero), then each block's scale
    times the row's global scale, S{r}_{j}_{h} (fp32, rounded as dequantize_fp4 rounds it)."""
    L = [f"{ind}c{j} = w0 + lw + {j * WARP_WORDS}" for j in range(U)]
    shift = 1 if blocks == 2 else 2  # chunk c covers inputs 8c .. 8c + 31: block 8c / group
    for j in range(U):
        for h in range(blocks):
            # clamped: a guarded chunk reads the row's last block and adds zero times it
            block = f"(c{j} >> {shift}) + {h}" if h else f"c{j} >> {shift}"
            L.append(f"{ind}i{j}_{h} = min({block}, G - 1)")
    for r in range(R):
        for j in range(U):
            L.append(f"{ind}q{r}_{j} = ld_w4(qw, (rw{r}, c{j})) if c{j} < W else ZERO_W4")
    for r in range(R):
        for j in range(U):
            L += [f"{ind}b{r}_{j}_{h} = ld1(scales, (rw{r}, i{j}_{h}))" for h in range(blocks)]
    for r in range(R):
        for j in range(U):
            for h in range(blocks):
                s = f"scale_f32(b{r}_{j}_{h}, {e8m0})"
                L.append(f"{ind}S{r}_{j}_{h} = {s} * gs{r}")
    return L


def _step(ind: str, M: int, R: int, U: int, blocks: int, e8m0: bool) -> list[str]:
    """One warp step of the table form: _step_loads, then per chunk, 8 inputs (one word) at a
    time: the R x 8 E2M1 values from the table, each x row's 8 inputs (one 16-byte load)
    against them into the block's partial sums p, and at a block's end p times the block's
    scale into a{m}_{r}.
    blocks: scale blocks per chunk (2 for blocks of 16, 1 for 32). Every temporary has a name
    of its own, the partial sums too (numba rebuilds SSA form per name assigned twice)."""
    L = _step_loads(ind, R, U, blocks, e8m0)
    xrows = ["0"] + [f"xm{m}" for m in range(1, M)]
    for j in range(U):
        # x of a chunk past the end is read at the last chunk's columns (in bounds) against
        # zero codes: no guard, no zero-fill per x value
        L.append(f"{ind}xc{j} = min(c{j}, Wl) * 8")
        for t in range(WORDS):
            h = t * blocks // WORDS
            for r in range(R):
                for e in range(8):
                    L.append(f"{ind}e{j}_{t}_{r}_{e} = tab[{_code(f'q{r}_{j}[{t}]', e)}]")
            first = t * blocks % WORDS == 0  # the block's first word
            for m in range(M):
                xv = f"xv{j}_{t}_{m}"
                L.append(f"{ind}{xv} = ld8(x, ({xrows[m]}, xc{j} + {8 * t}))")
                for r in range(R):
                    # the block's sum so far, then 8 products (a chain of FMAs)
                    terms = [] if first else [f"p{j}_{t - 1}_{m}_{r}"]
                    terms += [f"{xv}[{e}] * e{j}_{t}_{r}_{e}" for e in range(8)]
                    L.append(f"{ind}p{j}_{t}_{m}_{r} = {' + '.join(terms)}")
            if (t + 1) * blocks % WORDS == 0:  # the block's last word
                for m in range(M):
                    for r in range(R):
                        L.append(f"{ind}a{m}_{r} += p{j}_{t}_{m}_{r} * S{r}_{j}_{h}")
    return L


def _code(word: str, e: int) -> str:
    """Source of code e (bits 4e .. 4e + 3) of a uint32 code word, a table index."""
    if e == 0:
        return f"{word} & 15"
    if e == 7:
        return f"{word} >> 28"
    return f"({word} >> {4 * e}) & 15"


# The half2 form (module doc). A code in "byte form": magnitude (e1 e0 m) at bits 1-3, sign at
# bit 7, so that in a half's high byte it is the fp16 pattern (mag << 9) | (sign << 15), the E2M1
# value times 2**-14 (exponent field e1 e0, top mantissa bit m; e1 e0 = 0 the fp16 subnormals).
H2_MAG, H2_SIGN = 0x0E0E0E0E, 0x80808080  # the byte form's fields in every byte of a word
H2_UP = 0x2404  # prmt2(word, 0, .): bytes 0 and 2 into bytes 1 and 3, zero bytes below them
H2_HIGH = 0xFF00FF00  # bytes 1 and 3 in place
# Pairings of a word's codes into half2 (code a, code b) (`h2_gap`). FAR: (e, e + 4), e = 0..3,
# the codes 16 bits apart as stored; x pairs (x_e, x_e+4) are regrouped from the 16-byte x load's
# four half2 words ((x0, x1) .. (x6, x7)) by prmt2 of their low (0x5410) or high (0x7632) halves,
# four a word and input row. NEAR: (2e, 2e + 1), the x load's own pairs; the code word is
# regrouped first (nibbles 1 <-> 2 and 5 <-> 6 swapped, then bytes (0, 2, 1, 3): even codes in
# the low half, odd in the high), five instructions a word and row.
FAR, NEAR = 4, 1
H2_X_PAIRS = ((0, 2, 0x5410), (0, 2, 0x7632), (1, 3, 0x5410), (1, 3, 0x7632))
H2_SWAP, H2_BYTES = 0x00F000F0, 0x3120  # NEAR's nibble swap mask and byte order (prmt)


def h2_shift(group: int) -> int:
    """s of the half2 form's fp16 runs, which hold products x * v * 2**-s: each half of a block
    sums group / 2 of them, |v| <= 6 and |x| <= 65504, so 2**s > 3 * group keeps every run
    below 0.75 * 65504 (6 for blocks of 16, 7 for 32)."""
    return (3 * group - 1).bit_length()


def h2_gap(M: int, R: int) -> int:
    """The pairing of the M-row kernel with R rows a warp: FAR costs 4 prmt2 a word per input
    row (shared by the R rows), NEAR 5 instructions a word per weight row (shared by the M
    inputs); the cheaper one (FAR at a tie: no extra registers for regrouped words)."""
    return NEAR if 5 * R < 4 * M else FAR


def h2_decode(ind: str, word: str, name: str, gap: int = FAR) -> tuple[list[str], list[str]]:
    """Source of the half2 decode of code word `word` (code e at bits 4e): statements computing
    the codes at its nibbles 0, 2, 4, 6 in byte form into {name}e and those at 1, 3, 5, 7 into
    {name}o (one shift, one AND and one LOP3 for the odd nibbles, whose sign is in place; two
    shifts for the even ones: magnitude and sign move by different distances), and the
    expressions of its four half2 code pairs times 2**-14, each one prmt2 (bytes 0 and 2 moved
    up) or one AND (bytes 1 and 3): (code e, code e + 4) for gap FAR, (code 2e, code 2e + 1)
    for NEAR, whose statements regroup the word first into {name}w (see FAR, NEAR)."""
    L = []
    if gap == NEAR:
        t, u, w = f"{name}t", f"{name}u", f"{name}w"
        L += [
            f"{ind}{t} = ({word} ^ ({word} >> 4)) & {H2_SWAP:#x}",
            f"{ind}{u} = {word} ^ {t} ^ ({t} << 4)",
            f"{ind}{w} = prmt({u}, {H2_BYTES:#x})",
        ]
        word = w
    ev, od = f"{name}e", f"{name}o"
    L += [
        f"{ind}{ev} = (({word} << 1) & {H2_MAG:#x}) | (({word} << 4) & {H2_SIGN:#x})",
        f"{ind}{od} = (({word} >> 3) & {H2_MAG:#x}) | ({word} & {H2_SIGN:#x})",
    ]
    pairs = [
        f"prmt2({ev}, 0, {H2_UP:#x})",
        f"prmt2({od}, 0, {H2_UP:#x})",
        f"({ev} & {H2_HIGH:#x})",
        f"({od} & {H2_HIGH:#x})",
    ]
    return L, pairs


def _step_half2(ind: str, M: int, R: int, U: int, group: int, e8m0: bool) -> list[str]:
    """One warp step of the half2 form: _step_loads, then per chunk, one word (8 inputs) at a
    time: each x row's 16-byte load as the half2 pairs that meet the code pairs (h2_gap: FAR,
    the pairs (x_e, x_e+4), four prmt2 shared by the R rows; NEAR, the load's own pairs); per
    row the word's four code pairs (h2_decode) times 2**(14 - s) (one mul.f16x2 each, exact:
    the values v * 2**-s), then one fma.f16x2 per pair and x row into the block's fp16 run hs
    (per half: group / 2 products); at a block's end each run's halves widened to fp32 and
    times the block's scale into a{m}_{r}, which hold sums in units of 2**-s (the caller
    multiplies by 2**s). Every temporary has a name of its own (see _step)."""
    L = _step_loads(ind, R, U, 32 // group, e8m0)
    gap = h2_gap(M, R)
    words = group // 8  # code words of a block
    mul = h2_bits(2.0 ** (14 - h2_shift(group)), 2.0 ** (14 - h2_shift(group)))
    xrows = ["0"] + [f"xm{m}" for m in range(1, M)]
    for j in range(U):
        # x of a chunk past the end is read at the last chunk's columns (in bounds) against
        # zero codes, as in the table form
        L.append(f"{ind}xc{j} = min(c{j}, Wl) * 8")
        for t in range(WORDS):
            h, first = divmod(t, words)
            first = first == 0
            for m in range(M):
                xh = f"xh{j}_{t}_{m}"
                L.append(f"{ind}{xh} = ldh8(x, ({xrows[m]}, xc{j} + {8 * t}))")
                for e, (lo, hi, sel) in enumerate(H2_X_PAIRS):
                    if gap == FAR:
                        xp = f"prmt2({xh}[{lo}], {xh}[{hi}], {sel:#x})"
                    else:
                        xp = f"{xh}[{e}]"
                    L.append(f"{ind}xp{j}_{t}_{m}_{e} = {xp}")
            for r in range(R):
                dec, pairs = h2_decode(ind, f"q{r}_{j}[{t}]", f"d{j}_{t}_{r}", gap)
                L += dec
                for e, pair in enumerate(pairs):
                    L.append(f"{ind}k{j}_{t}_{r}_{e} = h2mul({pair}, {mul:#x})")
                for m in range(M):
                    prev = None if first else f"hs{j}_{t - 1}_3_{m}_{r}"
                    for e in range(4):
                        run = f"hs{j}_{t}_{e}_{m}_{r}"
                        xk = f"xp{j}_{t}_{m}_{e}, k{j}_{t}_{r}_{e}"
                        if prev is None:  # the run's first product
                            L.append(f"{ind}{run} = h2mul({xk})")
                        else:
                            L.append(f"{ind}{run} = h2fma({xk}, {prev})")
                        prev = run
            if (t + 1) % words == 0:  # the block's last word
                for m in range(M):
                    for r in range(R):
                        lo, hi = f"hl{j}_{h}_{m}_{r}", f"hu{j}_{h}_{m}_{r}"
                        L.append(f"{ind}{lo}, {hi} = h2f(hs{j}_{t}_3_{m}_{r})")
                        L.append(f"{ind}a{m}_{r} += {lo} * S{r}_{j}_{h}")
                        L.append(f"{ind}a{m}_{r} += {hi} * S{r}_{j}_{h}")
    return L


def _source(
    M: int, R: int, U: int, ks: int, gate_up: bool, group: int, e8m0: bool, form: str = TABLE
) -> str:
    """The kernel's source (see the module doc): x [Mx <= M, K] (fp16 for HALF2), qw int32
    [rows, K / 8], scales uint8 [rows, K / group], gscale fp32 [rows], bias, out [Mx, N],
    has_bias. form: TABLE or HALF2 (`form_for`)."""
    if form not in FORMS:
        raise ValueError(f"unknown FP4 dot-product form {form!r} (one of {FORMS})")
    acc = [f"a{m}_{r}" for m in range(M) for r in range(R)]
    L = ["def kernel(x, qw, scales, gscale, bias, out, has_bias):"]
    if form == TABLE:
        L += ["    tab = cuda.shared.array(16, float32)", "    fill_table(tab)"]
    L += [
        "    lane = cuda.threadIdx.x & 31",
        # the group of rows: ks consecutive warps share one
        "    grp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> "
        f"{5 + ks.bit_length() - 1}",
    ]
    L += _rows(R, gate_up)
    L += ["    Mx = x.shape[0]"] + [f"    xm{m} = min({m}, Mx - 1)" for m in range(1, M)]
    L += [f"    {a} = float32(0.0)" for a in acc]
    L += ["    lw = lane * 4", "    G = scales.shape[1]", f"    Wl = qw.shape[1] - {WORDS}"]
    L += _k_range(ks)
    L.append("    while w0 < W:")
    if form == HALF2:
        L += _step_half2("        ", M, R, U, group, e8m0)
    else:
        L += _step("        ", M, R, U, 32 // group, e8m0)
    L.append(f"        w0 += {U * WARP_WORDS}")
    if ks > 1:
        L += split_k_sum(ks, acc, dead_leave=False)
    if form == HALF2:  # the runs' units, 2**-s: exact (a power of two)
        L += [f"    {a} *= float32({2.0 ** h2_shift(group)!r})" for a in acc]
    # lane m * R + r (gate_up: m * R / 2 + q) writes input m's output of its row (column)
    L += gate_up_epilogue(M, R // 2) if gate_up else plain_epilogue(M, R)
    return "\n".join(L) + "\n"


@cached_factory
def _build(M: int, R: int, U: int, ks: int, gate_up: bool, group: int, e8m0: bool, form: str):
    # fill_table and scale_f32 inlined by NVVM, not numba: the same PTX instruction counts and
    # registers (scripts/ptx_diff.py), half the compile time of the 8-row kernel (31 -> 16 s)
    scope = {
        "cuda": cuda,
        "float32": float32,
        "ld1": ld1,
        "ld8": ld8,
        "ld_w4": ld_w4,
        "ZERO_W4": ZERO_W4,
        "ldh8": ldh8,
        "prmt": prmt,
        "prmt2": prmt2,
        "h2mul": h2mul,
        "h2fma": h2fma,
        "h2f": h2f,
        "fill_table": nvvm_inlined(fill_table),
        "scale_f32": nvvm_inlined(scale_f32),
        "_warp_sum": _warp_sum,
        "_silu_mul": _silu_mul,
        "round_like": round_like,
    }
    kind = "gate_up_" if gate_up else ""
    suffix = "_half2" if form == HALF2 else ""
    name = f"fp4_gemv_{kind}{scheme_name(group, e8m0)}_m{M}_r{R}u{U}ks{ks}{suffix}"
    src = _source(M, R, U, ks, gate_up, group, e8m0, form)
    exec(compile(src, f"<{name}>", "exec"), scope)  # noqa: S102 - our own generated source
    return cuda.jit(named_kernel(scope["kernel"], __name__, name))


_GEMV: dict[tuple, object] = {}


def fp4_gemv_kernel(
    m: int,
    gate_up: bool = False,
    group: int = 16,
    e8m0: bool = False,
    tile: Tile = None,
    form: str = TABLE,
):
    """The tiled kernel serving m input rows (its variant's) of a weight with blocks of `group`
    inputs and E8M0 (else E4M3) scales, built once per configuration. tile: (R, U) or
    (R, U, KS) instead of `tiling`'s default (benchmarks and tests). form: the dot product,
    TABLE (any x dtype) or HALF2 (fp16 x only); launchers take `form_for`'s."""
    if group not in (16, 32):
        raise ValueError(f"FP4 blocks of 16 or 32 inputs, got {group}")
    if form not in FORMS:
        raise ValueError(f"unknown FP4 dot-product form {form!r} (one of {FORMS})")
    key = (variant_for(m), *tiling(m, gate_up, tile), gate_up, group, bool(e8m0), form)
    k = _GEMV.get(key)
    if k is None:
        k = _GEMV[key] = _build(*key)
    return k


# Representative instances for `voltserve check-kernels` (kernels/linear/__init__.py), default
# tiles: NVFP4 at one row (split-K) in the table form, which the registry compiles for fp32 and
# fp16 x; the fp16-only entries in the form fp16 x runs, half2: NVFP4 at 8 rows (R = 2, U = 2),
# MXFP4 at one row and gate_up at one row. fp4_gemv_half2_kernel_m1 (NVFP4 at one row, half2)
# is the instance whose loop the module doc counts.
fp4_gemv_kernel_m1 = fp4_gemv_kernel(1)
fp4_gemv_kernel_m8 = fp4_gemv_kernel(8, form=HALF2)
fp4_gemv_mxfp4_kernel_m1 = fp4_gemv_kernel(1, group=32, e8m0=True, form=HALF2)
fp4_gemv_gate_up_kernel_m1 = fp4_gemv_kernel(1, gate_up=True, form=HALF2)
fp4_gemv_half2_kernel_m1 = fp4_gemv_kernel(1, form=HALF2)

__all__ = [
    "FORMS",
    "HALF2",
    "TABLE",
    "V1",
    "Tile",
    "decode_chunk",
    "dot_chunk",
    "e2m1_value",
    "fill_table",
    "fp4_dequant_kernel",
    "fp4_gemv_kernel",
    "fp4_gemv_v1_kernel",
    "form_for",
    "grid_for",
    "h2_decode",
    "h2_gap",
    "h2_shift",
    "scale_f32",
    "scheme_name",
    "tile_for",
    "tiling",
    "v1_grid",
    "variant_for",
]
