"""Fused dequantize-GEMV for group-quantized weights (decode, 1..8 rows):
y[M, N] = x[M, K] @ dequantize(w)^T (+ bias), reference `quant_linear_ref` (quant_linear.py).

At decode a linear is a pure weight stream, and with 4-bit codes the stream is a quarter of the
fp16 one, so the kernel must read code words at the bandwidth floor while doing ~4 instructions
per weight. It follows gemv.py's structure:

- one warp owns R consecutive output rows for all M inputs; each lane reads 16 bytes of a row
  per chunk (4 code words: 32 int4 or 16 int8 codes), U chunks per step, and issues all R * U
  16-byte loads of a step, with the (scale, offset) of each, before the first multiply;
- codes become fp32 with a shift and a LOP3 each (quant_common.py: no I2F), one FMA with the
  group's folded (S, O) dequantises, one FMA per input row accumulates in fp32; x is read next
  to its use in 16-byte loads (a few KB: L1/L2 hits after the first warp), each load serving the
  warp's R rows;
- lane partial sums are reduced with warp shuffles; lane i writes output i with one rounding.

Split-K (the tile's KS, `tiling`; the int4 default at one row is KS = 2, SPLIT_K_M1, measured;
elsewhere KS = 1, no split): the KS warps of a block (KS in 1, 2, 4 of its 4) own the same R rows, warp p walking
the p-th 1/KS share of the code words, cut at whole warp chunks (128 words, every lane one
16-byte chunk) so that the (scale, offset) lookups, indexed by the global word, are unchanged,
and the share's end takes the guards of the weight's end (`_split_k_range`). After the loop
warps 1..KS-1 store their lane sums in shared memory and leave after the block's barrier;
warp 0 adds them in warp order (deterministic: the same sum every run) and runs the epilogue
as a KS = 1 warp does (`split_k_sum`; the generated KS = 1 kernel has none of this). A block
then covers 4 / KS groups: R rows, R / 2 gate_up columns or one rotary pair each (`grid_for`).
The aim: the short linears are latency-bound (down at R = 4 is 1024 warps, ~8 an SM on 132
SMs, each walking 14 warp chunks of its rows one after another), and KS warps cut that walk
to 14 / KS with KS times the warps. Sums regroup in fp32 only (half2's fp16 runs stay one per
lane chunk). cc 7.0, M = 1 half2: R = 4, U = 2 80 -> 92 registers at KS = 4 (2 KB of shared
memory a block), gate_up (R = 4, U = 1) 96 -> 104, qkv_rope (R = 2, U = 2) 64 -> 72, no spills.

Dot-product forms (`form_for` picks one per launch; `form` forces one for benchmarks and tests):

- WEIGHT (fp32 x; fp16 x with int8 codes or int4 split groups at 3-8 rows): each weight
  dequantised as above.
- FACTORED (fp16 x at 1-2 rows for int8 codes and int4 split groups; faster than the
  per-weight form on every Llama-3-8B int4 g128 shape at 1-2 rows, BENCHMARKS.md §12): a
  chunk's codes share one (s, o),
  so the step sums x_k * c_k and x_k per chunk and applies s and o once per chunk (two FFMAs per
  row and input). The masked code word is read as a float proportional to the code
  (quant_common.code_d_expr: one AND for most codes, no shift, no OR), each x element is scaled
  to its code's bit position once per chunk (shared by the R rows), and there is no
  dequantising FFMA: in the PTX of the M = 1 int4 kernel ~3.0 instructions a weight instead of
  ~5.4 (~4.4 after ptxas merges AND + OR into LOP3). Same products (exact), sums regrouped per
  chunk: the result differs from the per-weight form by fp32 rounding only.
- HALF2 (fp16 x at 1-8 rows, int4 codes with groups >= 32; `_half2_chunk`): two codes per
  instruction. Codes are pair-interleaved (code e of a word at bit 16 (e & 1) + 4 (e >> 1)), so
  `(u & 0x000F000F) | 0x64006400` read as half2 is (1024 + c0, 1024 + c1) and the 0x00F000F0 mask
  gives (1024 + 16 c2, 1024 + 16 c3); u >> 8 gives the other two pairs: one shift and four
  LOP3s per word of 8 codes. One fma.f16x2 per pair makes the exact (c - 8) * 2**-8 (the codes
  centred, the 2**-8 for range), and the 16-byte x load is already the half2 pairs (x0, x1) ..
  (x6, x7) that meet those code pairs, so one fma.f16x2 adds two products. Per chunk (16
  products per half) and per (row, input) the fp16 sum is widened to fp32 once and folded with
  the factored identity, sum_k x_k (s c_k + o) = s * sum_k x_k (c_k - 8) + (o + 8 s) * sum_k
  x_k, where sum_k x_k * 2**-8 is an fp16 run of 16 per half too (shared by the R rows); across
  chunks, groups and steps the sums accumulate in fp32, multiplied by 2**8 at the end. PTX of
  the loop (cc 7.0, check-kernels; address, guard and load instructions and register moves
  left out, AND + OR counted as one LOP3): M = 1, R = 4, U = 2: 518 instructions a step of 256
  weights, 2.0 a weight (factored 774, 3.0): 1.125 f16x2 FMA/MUL, 0.5 LOP3, 0.125 shift, 0.27
  widening and folding; 80 registers (factored 106). M = 2: 2.8 a weight (factored 4.8), 106
  registers; M = 4 (R = 4, U = 1): 4.4 a weight against 8.1 for the per-weight form, 178
  registers against 254; M = 8 (R = 2, U = 2): 8.8 against 15.1, 162 registers against 156.
  Not yet measured on a GPU.

  Precision (fp16 storage, fp32 accumulation; fp16 only inside a run of 16 terms, as the
  production exllama / AWQ GEMVs do): every code value and x * 2**-8 product is exact, and
  each of a run's 16 fma.f16x2 rounds its running sum once, by at most 2**-11 of it (<= the sum
  of the run's term magnitudes, to first order) or by 2**-25 where it is an fp16 subnormal.
  The product runs are scaled by 2**8 |s| and the x runs by 2**8 |o + 8 s|, so against the
  exact sum (and the fp32 factored form, whose own error is ~2**-24 of it)

      |y - y_exact| <= 2**-7 * sum_k |x_k| (|s| |c_k - 8| + |o + 8 s|)
                       + 2**-17 * sum_k (|s| + |o + 8 s|)  (+ fp32 rounding)

  The first term is the worst case of 16 same-signed roundings per run; random rounding
  errors average out to ~2**-11 of a run's magnitude, so in simulator runs at |y| ~ 1 the
  error is ~4e-4 of max |y| (factored ~1e-7), about one fp16 ulp of the output. The second
  term is the subnormal loss of small x: |x| < 2**-6 loses its bits below 2**-24 after the
  2**-8 scaling, 2**-17 absolute per rounding (at |x| ~ 1e-4 everywhere ~4e-3 of |y|). Range:
  |x| <= 65504 and |c - 8| <= 8 keep every run below 16 * 8 * 65504 * 2**-8 = 32752, so no
  fp16 x overflows (fp32 x keeps the per-weight form). The f16x2 instructions are `.rn`
  without `.ftz` (kernels/runtime/half2.py): subnormals are kept.

Groups: a 16-byte chunk of codes starts at a multiple of 32 (int4) / 16 (int8) inputs, so for
group sizes >= 32 (int4) / >= 16 (int8) it lies in one group: one (scale, offset) per chunk per
row. int4 with group 16 (GGUF K-quant sub-blocks) is the SPLIT variant: words 0-1 and 2-3 of a
chunk take consecutive groups. Per-channel weights (g = K) have group_shift 30: every k maps to
group 0.

The gate_up variant (kind GATE_UP) owns gate rows j.. and up rows I + j.. in one warp and writes
silu_and_mul's h[m, j], rounded as the unfused path rounds (the product to the storage dtype,
silu, then the product), like gemv.py's.

Requirements (checked on the host by `supports`, otherwise quant_linear takes another path):
K a multiple of 32 (int4) / 16 (int8) so chunks are whole 16-byte words; qweight, x and out
16-byte aligned with unit last stride. Every chunk load is guarded (zeros past K: one body for
full and partial steps); a partial last group of rows re-reads row N - 1 and does not write it.

M, R, U, KS, bits and SPLIT are compile-time constants of a generated kernel (one per combination,
built on first use), so accumulators and in-flight words stay in registers.
"""

from __future__ import annotations

import torch
from numba import cuda, uint32
from voltserve.kernels.attention.rotary import _rot1
from voltserve.kernels.elementwise.activation import _silu_mul
from voltserve.kernels.linear.gemv import QKV_ROPE_PROLOGUE, QKV_ROPE_STORE, _warp_sum
from voltserve.kernels.linear.quant_common import (
    D_SCALE,
    ZERO_W4,
    bits_f32,
    code_bit,
    code_d_expr,
    code_f_expr,
    fold,
    fold_dot,
    ld_w4,
    x_scale,
)
from voltserve.kernels.linear.quant_pack import GroupQuantWeight
from voltserve.kernels.runtime.compile_cache import cached_factory
from voltserve.kernels.runtime.half2 import h2_bits, h2f, h2fma, h2mul, ldh8
from voltserve.kernels.runtime.launch_geometry import on_gpu
from voltserve.kernels.runtime.numba_common import current_stream, float32, launch, round_like
from voltserve.kernels.runtime.vec_io import ZERO8, ld8

MAX_M = 8
WARPS = 4
THREADS = 32 * WARPS
WORDS_PER_CHUNK = 4  # 16 bytes
WARP_WORDS = 32 * WORDS_PER_CHUNK  # code words a warp reads per chunk (128)
VARIANTS = (1, 2, 4, 8)
PLAIN, GATE_UP, QKV_ROPE = "plain", "gate_up", "qkv_rope"
# Dot-product forms (dot_step): per weight, factored per chunk in fp32, half2 (fp16 pairs).
WEIGHT, FACTORED, HALF2 = "weight", "factored", "half2"
FORMS = (WEIGHT, FACTORED, HALF2)
# Split-K: warps of a block on the same rows, each over a 1/KS share of K (`_split_k_range`).
KS_CHOICES = (1, 2, 4)
# The int4 default at one row (plain and gate_up): two warps of a block on 4 rows, each half of
# K, one chunk per lane per step: faster than one warp on every Llama-3-8B int4 g128 shape
# (bench_quant_linear --tiles, BENCHMARKS.md §12), while KS = 4 loses on every shape: a
# quarter of K is too short a walk for its warps.
# Rows 2-8, int8 and qkv_rope (2, 2) keep KS = 1: not measured.
SPLIT_K_M1 = (4, 1, 2)


def variant_for(m: int) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"quantized gemv kernels cover M = 1..{MAX_M}, got {m}")
    return next(v for v in VARIANTS if v >= m)


def tile_for(m: int, bits: int, kind: str = PLAIN) -> tuple[int, int]:
    """(R rows per warp, U chunks per lane per step): R * U 16-byte loads in flight per lane.

    Why R = 4 for int4: every x element a lane reads is widened fp16 -> fp32 once per row it
    meets, and a chunk of 32 codes needs 32 of them; conversions run at a quarter of the FP32
    rate on Volta, so at R = 1 they, not the weight stream, would bound the kernel. Four rows
    per warp share each converted x value (8 conversions per chunk and row) and cut x's L1
    traffic per weight byte to M bytes. The generated body (R * U * 32 * M multiply-adds) stays
    small enough to compile. M = 8 takes R = 2: its 8 x 4 accumulators and 4 x 8 dequantised
    weights did not fit 255 registers at R = 4. At R = 4 a 4096-row weight is only 1024 warps
    (~8 per SM): int4 at M <= 2 keeps two chunks per row in flight (U = 2, 128 bytes a lane) so
    that enough of the stream is in flight. gate_up: R = 4 is two (gate j, up I + j) pairs, and
    its 14336 columns make warps plentiful.

    Split-K (KS, the tile's optional third entry, `tiling`): KS warps of a block own the same
    rows, each walking a 1/KS share of K, their lane sums added through shared memory before
    the epilogue. `tiling` takes (4, 1, 2) for int4 plain and gate_up at one row (SPLIT_K_M1,
    measured: the short int4 linears are latency-bound, down has ~8 warps an SM at KS = 1, each
    14 serial warp chunks of its rows), these (R, U) with KS = 1 elsewhere."""
    if kind == QKV_ROPE:
        return (2, 2)  # the rotary pair (dims j and j + D/2 of one head)
    if m == 8:
        return (2, 2)  # R = 4 at M = 8 needs more than 255 registers (spills)
    if bits == 4:
        return (4, 1) if kind == GATE_UP or m == 4 else (4, 2)
    return (4, 1) if m == 4 else (2, 2)


def tiling(m: int, bits: int, kind: str = PLAIN, tile=None) -> tuple[int, int, int]:
    """(R, U, KS) of a launch: tile (R, U) or (R, U, KS) when given (benchmarks and tests),
    else the default: int4 at one row, plain and gate_up, (4, 1, 2) (SPLIT_K_M1), otherwise
    tile_for's (R, U) with KS = 1."""
    if tile is None:
        v = variant_for(m)
        if v == 1 and bits == 4 and kind in (PLAIN, GATE_UP):
            return SPLIT_K_M1
        return (*tile_for(v, bits, kind), 1)
    if len(tile) == 2:
        return (*tile, 1)
    R, U, KS = tile
    if KS not in KS_CHOICES:
        raise ValueError(f"split-K over {KS} warps: KS must be one of {KS_CHOICES}")
    return R, U, KS


def _x_load(ind: str, dst: str, row: str, j: int, t: int, col: str, guarded: bool, half2=False):
    """Source of one 16-byte x load (8 inputs from column `col` of x row `row`) into `dst`: as
    eight floats (ld8) or four half2 words (ldh8), zeros past K when guarded (the column then
    sits in xc{j}_{t}, which the caller assigns once for its M loads)."""
    load, zero = ("ldh8", "ZERO_W4") if half2 else ("ld8", "ZERO8")
    if guarded:
        return f"{ind}{dst} = {load}(x, ({row}, xc{j}_{t})) if xc{j}_{t} < K else {zero}"
    return f"{ind}{dst} = {load}(x, ({row}, {col}))"


def dot_step(
    ind: str,
    M: int,
    R: int,
    U: int,
    bits: int,
    split: bool,
    xrows: list[str],
    weight: str | None = None,
    guarded: bool = True,
    form: str = "weight",
) -> list[str]:
    """Source of one warp step (U chunks per lane of R weight rows rw0..rw{R-1}, code words from
    word w0) accumulated into a{m}_{r} against x rows xrows[m]: every load of the step issued
    before the first multiply, codes dequantised in registers with the group's folded (S, O).
    weight: a variable scaling every weight of the step (MoE routing weights folded into S and
    O, kernels/moe/quant_decode.py). Also the per-expert steps of the int4 MoE kernels.
    form: WEIGHT dequantises each weight; FACTORED (`_factored_chunk`) and HALF2
    (`_half2_chunk`, int4 codes and one group per chunk only) apply the group's scale and
    offset once per chunk."""
    if form not in FORMS:
        raise ValueError(f"unknown dot-product form {form!r} (one of {FORMS})")
    if form == HALF2 and (bits != 4 or split):
        raise ValueError("the half2 step is for int4 codes with one group per chunk")
    P = 32 // bits
    out = [f"{ind}c{j} = w0 + lw + {j * WARP_WORDS}" for j in range(U)]
    # Group of each chunk (and of its second half for SPLIT), clamped for guarded chunks.
    for j in range(U):
        out.append(f"{ind}g{j} = min((c{j} * {P}) >> gshift, G - 1)")
        if split:
            out.append(f"{ind}h{j} = min(((c{j} + 2) * {P}) >> gshift, G - 1)")
    # Every load of the step before the first use: code words, then scales and offsets.
    for r in range(R):
        for j in range(U):
            if guarded:
                # Guards written out, not inlined helpers: see quant_common.bits_f32.
                out.append(f"{ind}q{r}_{j} = ld_w4(qw, (rw{r}, c{j})) if c{j} < W else ZERO_W4")
            else:
                out.append(f"{ind}q{r}_{j} = ld_w4(qw, (rw{r}, c{j}))")
    for r in range(R):
        for j in range(U):
            out.append(f"{ind}s{r}_{j} = scales[rw{r}, g{j}]")
            out.append(f"{ind}o{r}_{j} = offsets[rw{r}, g{j}]")
            if split:
                out.append(f"{ind}t{r}_{j} = scales[rw{r}, h{j}]")
                out.append(f"{ind}p{r}_{j} = offsets[rw{r}, h{j}]")
    # Every temporary of the step has a name of its own (chunk j, x load t, row r, input e or
    # m): numba rebuilds SSA form for each name assigned more than once, over the whole kernel,
    # so reusing names costs seconds of compile per kernel (the PTX is the same either way).
    if form == FACTORED:
        if weight is not None:
            raise ValueError("the factored step has no routing weight (MoE keeps the other)")
        for j in range(U):
            out += _factored_chunk(ind, j, M, R, bits, split, xrows, guarded)
        return out
    if form == HALF2:
        for j in range(U):
            out += _half2_chunk(ind, j, M, R, xrows, guarded, weight)
        return out
    for j in range(U):
        for r in range(R):
            halves = [("S", "O", "s", "o")] + ([("T", "Q", "t", "p")] if split else [])
            for sc, of, sv, ov in halves:
                S, O_ = f"{sc}{r}_{j}", f"{of}{r}_{j}"
                dst = f"{S}u, {O_}u" if weight is not None else f"{S}, {O_}"
                out.append(f"{ind}{dst} = fold({sv}{r}_{j}, {ov}{r}_{j}, {1 << bits})")
                if weight is not None:
                    out.append(f"{ind}{S} = {S}u * {weight}")
                    out.append(f"{ind}{O_} = {O_}u * {weight}")
        # 8 inputs per x load: one word of int4 codes, two words of int8.
        n_x = WORDS_PER_CHUNK * P // 8
        for t in range(n_x):
            col = f"(c{j} + {t * 8 // P}) * {P}"
            # The R x 8 weights these inputs meet, dequantised once; then each input row
            # (one x load) against all of them: few values live at once for any M.
            for e in range(8):
                word = t * 8 // P + e // P  # word of the chunk holding input e
                p = code_bit(e % P, bits)
                sc, of = ("T", "Q") if split and word >= 2 else ("S", "O")
                for r in range(R):
                    f = code_f_expr(f"q{r}_{j}[{word}]", p, bits)
                    out.append(f"{ind}wv{j}_{t}_{r}_{e} = {f} * {sc}{r}_{j} + {of}{r}_{j}")
            if guarded:
                out.append(f"{ind}xc{j}_{t} = {col}")
            for m in range(M):
                xm, xv = xrows[m], f"xv{j}_{t}_{m}"
                out.append(_x_load(ind, xv, xm, j, t, col, guarded))
                for e in range(8):
                    for r in range(R):
                        out.append(f"{ind}a{m}_{r} += {xv}[{e}] * wv{j}_{t}_{r}_{e}")
    return out


def _factored_chunk(
    ind: str,
    j: int,
    M: int,
    R: int,
    bits: int,
    split: bool,
    xrows: list[str],
    guarded: bool,
) -> list[str]:
    """Chunk j of a factored step: the chunk's codes share one group (one per half for SPLIT),
    so sum_k x_k (c_k s + o) = s * sum_k x_k c_k + o * sum_k x_k. Each code becomes a float
    proportional to it in place (quant_common.code_d_expr: one integer op for most codes),
    each x element is scaled once per chunk to meet its code's bit position (one FMUL, shared
    by the R rows) and summed (one FADD, shared), and the products accumulate in fp32 per
    (row, input, half); the chunk ends with two FFMAs per (row, input, half) into a{m}_{r}."""
    P = 32 // bits
    n_x = WORDS_PER_CHUNK * P // 8
    halves = 2 if split else 1
    half_of = (lambda word: word >> 1) if split else (lambda word: 0)
    out = []
    started = set()  # chunk accumulators already assigned (the first product initialises)

    def acc(name: str, value: str) -> str:
        op = "+=" if name in started else "="
        started.add(name)
        return f"{ind}{name} {op} {value}"

    for t in range(n_x):
        col = f"(c{j} + {t * 8 // P}) * {P}"
        # The M x loads first: a guarded load is a branch, and codes decoded before one and used
        # after it were decoded again per input in the PTX (M = 2: twice the integer ops).
        if guarded:
            out.append(f"{ind}xc{j}_{t} = {col}")
        for m in range(M):
            xm, xv = xrows[m], f"xv{j}_{t}_{m}"
            out.append(_x_load(ind, xv, xm, j, t, col, guarded))
        qs = []
        for e in range(8):
            word = t * 8 // P + e // P
            expr, q = code_d_expr(f"q{{r}}_{j}[{word}]", code_bit(e % P, bits), bits)
            qs.append(q)
            for r in range(R):
                out.append(f"{ind}dv{j}_{t}_{r}_{e} = {expr.format(r=r)}")
        for m in range(M):
            xv = f"xv{j}_{t}_{m}"
            for e in range(8):
                h = half_of(t * 8 // P + e // P)
                out.append(f"{ind}xs{j}_{t}_{m}_{e} = {xv}[{e}] * float32({x_scale(qs[e])!r})")
                out.append(acc(f"sx{j}_{h}_{m}", f"{xv}[{e}]"))
                for r in range(R):
                    out.append(acc(f"dd{j}_{h}_{m}_{r}", f"xs{j}_{t}_{m}_{e} * dv{j}_{t}_{r}_{e}"))
    for r in range(R):
        for h in range(halves):
            sv, ov = ("t", "p") if h else ("s", "o")
            S, O_ = f"F{h}_{r}_{j}", f"G{h}_{r}_{j}"
            scale = 2.0 ** (149 - D_SCALE)
            out.append(f"{ind}{S}, {O_} = fold_dot({sv}{r}_{j}, {ov}{r}_{j}, {scale!r})")
            for m in range(M):
                out.append(f"{ind}a{m}_{r} += dd{j}_{h}_{m}_{r} * {S}")
                out.append(f"{ind}a{m}_{r} += sx{j}_{h}_{m} * {O_}")
    return out


# Half2 form constants (integer literals of the generated source). A code word u holds the
# pairs (e0, e1) at bits (0, 16), (e2, e3) at (4, 20), (e4, e5) at (8, 24), (e6, e7) at (12, 28)
# (quant_common.code_bit); MASK_LO keeps the first pair of u (of u >> 8: the third), MASK_HI the
# second (the fourth), and MAGIC makes each half 1024 + c (MASK_LO) or 1024 + 16 c (MASK_HI).
H2_MASK_LO, H2_MASK_HI, H2_MAGIC = 0x000F000F, 0x00F000F0, 0x64006400
H2_SHIFT = 8  # fp16 sums in units of 2**-8: the caller multiplies by 2**H2_SHIFT
# (c - 8) * 2**-8 from 1024 + c and from 1024 + 16 c: one fma.f16x2 each, exact.
H2_LO_MUL, H2_LO_ADD = h2_bits(2.0**-8, 2.0**-8), h2_bits(-1032 / 256, -1032 / 256)
H2_HI_MUL, H2_HI_ADD = h2_bits(2.0**-12, 2.0**-12), h2_bits(-1152 / 4096, -1152 / 4096)
H2_X = h2_bits(2.0**-8, 2.0**-8)  # x's sum in the same units
H2_CENTER = 8.0  # codes enter the products as c - 8: the offset becomes o + 8 s


def _half2_chunk(
    ind: str, j: int, M: int, R: int, xrows: list[str], guarded: bool, weight: str | None
) -> list[str]:
    """Chunk j of a half2 step (int4, one group per chunk): two codes per instruction. A word's
    four code pairs become half2 (1024 + c) or (1024 + 16 c) with one LOP3 each (plus one shift
    per word), then the exact (c - 8) * 2**-8 with one fma.f16x2; the 16-byte x load is already
    the matching half2 pairs, so each fma.f16x2 adds two products x * (c - 8) * 2**-8 to the
    (row, input) accumulator. The chunk's 16 products per half are summed in fp16, as is
    sum_k x_k * 2**-8 per input (shared by the R rows); both are widened to fp32 once per
    chunk and folded in fp32: sum_k x_k (s c_k + o) = s sum_k x_k (c_k - 8) + (o + 8 s) sum_k
    x_k. Sums are in units of 2**-8 (H2_SHIFT); weight (MoE) scales s and o and must include
    the 2**8, else the caller multiplies the accumulators by it."""
    out = []
    started = set()

    def acc(name: str, a: str, b: str) -> str:
        if name in started:
            return f"{ind}{name} = h2fma({a}, {b}, {name})"
        started.add(name)
        return f"{ind}{name} = h2mul({a}, {b})"

    for t in range(WORDS_PER_CHUNK):
        col = f"(c{j} + {t}) * 8"
        if guarded:
            out.append(f"{ind}xc{j}_{t} = {col}")
        for m in range(M):
            xm, xv = xrows[m], f"xh{j}_{t}_{m}"
            out.append(_x_load(ind, xv, xm, j, t, col, guarded, half2=True))
            for p in range(4):
                out.append(acc(f"sx{j}_{m}", f"{xv}[{p}]", f"{H2_X:#x}"))
        for r in range(R):
            u, v = f"q{r}_{j}[{t}]", f"qv{j}_{t}_{r}"
            out.append(f"{ind}{v} = {u} >> 8")
            for p, (word, mask, mul, add) in enumerate(
                (
                    (u, H2_MASK_LO, H2_LO_MUL, H2_LO_ADD),
                    (u, H2_MASK_HI, H2_HI_MUL, H2_HI_ADD),
                    (v, H2_MASK_LO, H2_LO_MUL, H2_LO_ADD),
                    (v, H2_MASK_HI, H2_HI_MUL, H2_HI_ADD),
                )
            ):
                code = f"({word} & {mask:#x}) | {H2_MAGIC:#x}"
                out.append(f"{ind}k{j}_{t}_{r}_{p} = h2fma({code}, {mul:#x}, {add:#x})")
            for m in range(M):
                for p in range(4):
                    out.append(acc(f"hh{j}_{m}_{r}", f"xh{j}_{t}_{m}[{p}]", f"k{j}_{t}_{r}_{p}"))
    for m in range(M):
        out.append(f"{ind}xl{j}_{m}, xu{j}_{m} = h2f(sx{j}_{m})")
        out.append(f"{ind}xs{j}_{m} = xl{j}_{m} + xu{j}_{m}")
    for r in range(R):
        F, G = f"F{r}_{j}", f"G{r}_{j}"
        if weight is None:
            out.append(f"{ind}{F} = float32(s{r}_{j})")
            out.append(f"{ind}{G} = float32(o{r}_{j}) + {F} * float32({H2_CENTER!r})")
        else:
            out.append(f"{ind}{F} = float32(s{r}_{j}) * {weight}")
            out.append(f"{ind}{G} = float32(o{r}_{j}) * {weight} + {F} * float32({H2_CENTER!r})")
        for m in range(M):
            lo, hi = f"pl{j}_{m}_{r}", f"pu{j}_{m}_{r}"
            out.append(f"{ind}{lo}, {hi} = h2f(hh{j}_{m}_{r})")
            out.append(f"{ind}a{m}_{r} += {lo} * {F}")
            out.append(f"{ind}a{m}_{r} += {hi} * {F}")
            out.append(f"{ind}a{m}_{r} += xs{j}_{m} * {G}")
    return out


def _source(
    M: int, R: int, U: int, bits: int, split: bool, kind: str, form: str = "weight", ks: int = 1
) -> str:
    """One kernel, written out statement by statement (see gemv._source for why). ks: warps of
    a block sharing one group of rows, each over a 1/ks share of K (KS of the tile, `_split_k`);
    ks = 1 writes the kernel without any of it."""
    if ks not in KS_CHOICES:
        raise ValueError(f"split-K over {ks} warps: KS must be one of {KS_CHOICES}")
    gate_up, rope = kind == GATE_UP, kind == QKV_ROPE
    acc = [f"a{m}_{r}" for m in range(M) for r in range(R)]
    step = U * WARP_WORDS  # words per step
    args = "x, qw, scales, offsets, bias, out, has_bias, gshift"
    if rope:
        args += ", positions, cos_sin, k_cache, v_cache, slots, n_q, n_kv"
    # warp: the group of rows (ks > 1: the block's ks consecutive warps share it).
    L = [
        f"def kernel({args}):",
        "    lane = cuda.threadIdx.x & 31",
        "    warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> "
        f"{5 + (ks.bit_length() - 1)}",
    ]
    if ks == 1:
        L += ["    K = x.shape[1]", "    W = qw.shape[1]"]
    L.append("    G = scales.shape[1]")

    def leave(cond: str, why: str) -> list[str]:
        # ks > 1: no warp leaves before the block's barrier; a group past the end walks no K
        # and leaves after it (`_split_k`).
        if ks == 1:
            return [f"    if {cond}:", f"        return{why}"]
        return [f"    live = not ({cond})"]

    if gate_up:
        Q = R // 2  # output columns per warp: gate rows row0 + q, up rows N + row0 + q
        L += ["    N = qw.shape[0] >> 1", f"    row0 = warp * {Q}"] + leave("row0 >= N", "")
        for q in range(Q):
            L += [f"    rw{2 * q} = min(row0 + {q}, N - 1)", f"    rw{2 * q + 1} = rw{2 * q} + N"]
    elif rope:
        L += ["    D = k_cache.shape[3]", "    half = D >> 1"]
        L += leave(
            "warp >= qw.shape[0] >> 1",
            "  # the whole warp leaves together: the shuffles stay full-mask",
        )
        L += [
            "    head = warp // half",
            "    j = warp - head * half",
            "    rw0 = head * D + j",
            "    rw1 = rw0 + half",
        ]
    else:
        L += ["    N = qw.shape[0]", f"    row0 = warp * {R}"]
        L += leave("row0 >= N", "  # the whole warp leaves together: the shuffles stay full-mask")
        L += [f"    rw{r} = min(row0 + {r}, N - 1)" for r in range(R)]
    L.append("    Mx = x.shape[0]")
    L += [f"    xm{m} = min({m}, Mx - 1)" for m in range(1, M)]
    if rope:
        L += QKV_ROPE_PROLOGUE
    L += [f"    {a} = float32(0.0)" for a in acc]
    if ks == 1:
        L += [f"    lw = lane * {WORDS_PER_CHUNK}", "    w0 = 0"]
    else:
        L += [f"    lw = lane * {WORDS_PER_CHUNK}"] + _split_k_range(ks, bits)

    # One guarded body (a compare per 16-byte load): half the code of a separate tail step.
    L.append("    while w0 < W:")
    xrows = ["0"] + [f"xm{m}" for m in range(1, M)]
    L += dot_step("        ", M, R, U, bits, split, xrows, form=form)
    L.append(f"        w0 += {step}")
    if ks > 1:
        L += split_k_sum(ks, acc)
    if form == HALF2:
        L += [f"    {a} *= float32({2.0**H2_SHIFT!r})" for a in acc]
    if gate_up:
        L += gate_up_epilogue(M, Q)
        return "\n".join(L) + "\n"
    if rope:
        # Lane m keeps input m's pair, rounded as the linear stores q/k/v, then rotated as
        # rotary.py rotates and written to out and (k, v) to the cache (gemv_qkv_rope.py).
        L += ["    a = float32(0.0)", "    b = float32(0.0)"]
        for m in range(M):
            L += [
                f"    ta = _warp_sum(a{m}_0)",
                f"    tb = _warp_sum(a{m}_1)",
                f"    if lane == {m}:",
                "        a = ta",
                "        b = tb",
            ]
        L += [
            f"    if lane < {M} and lane < Mx:",
            "        if has_bias:",
            "            a += float32(bias[rw0])",
            "            b += float32(bias[rw1])",
        ]
        L += QKV_ROPE_STORE
        return "\n".join(L) + "\n"
    L += plain_epilogue(M, R)
    return "\n".join(L) + "\n"


def _split_k_range(ks: int, bits: int) -> list[str]:
    """Split-K (ks > 1), the K range of warp `part` of its group: whole warp chunks (128 code
    words, every lane one 16-byte chunk), ceil(chunks / ks) a warp, the last share shorter or
    empty. W and K become the range's end in words and inputs, so dot_step's guards (code
    words c < W, x columns < K) cut the last step of each share as they cut the weight's
    partial last step; the group lookups index by the global word c and are unchanged. A group
    past the last row (not live) gets an empty range."""
    P = 32 // bits
    return [
        f"    part = (cuda.threadIdx.x >> 5) & {ks - 1}",
        "    Wt = qw.shape[1]",
        f"    span = ((Wt + {WARP_WORDS * ks - 1}) // {WARP_WORDS * ks}) * {WARP_WORDS}",
        "    w0 = part * span",
        "    W = min(w0 + span, Wt) if live else w0",
        f"    K = W * {P}",
    ]


def plain_epilogue(M: int, R: int) -> list[str]:
    """The plain kind's epilogue (a warp's accumulators a{m}_{r}: input m's sum of row row0 + r):
    lane m * R + r takes that warp sum and writes out[m, row0 + r] where the row is below N and
    input m exists, bias added in fp32, one rounding."""
    L = ["    mine = float32(0.0)"]
    for m in range(M):
        for r in range(R):
            i = m * R + r
            L += [f"    t{i} = _warp_sum(a{m}_{r})", f"    if lane == {i}:", f"        mine = t{i}"]
    return L + [
        f"    if lane < {M * R}:",
        f"        row = row0 + lane % {R}",
        f"        if row < N and lane // {R} < Mx:",
        "            if has_bias:",
        "                mine += float32(bias[row])",
        f"            out[lane // {R}, row] = mine",
    ]


def gate_up_epilogue(M: int, Q: int) -> list[str]:
    """The gate_up kinds' epilogue (a warp's accumulators a{m}_{2q} / a{m}_{2q+1}: input m's gate
    and up sums of column row0 + q): lane m * Q + q takes that pair's warp sums and writes
    silu_and_mul's h[m, row0 + q] where the column is below N and input m exists, bias added
    in fp32, each sum rounded as the linear stores it, then as silu_and_mul rounds h. Each
    temporary has a name of its own (see dot_step)."""
    L = ["    a = float32(0.0)", "    b = float32(0.0)"]
    for m in range(M):
        for q in range(Q):
            i = m * Q + q
            L += [
                f"    ta{i} = _warp_sum(a{m}_{2 * q})",
                f"    tb{i} = _warp_sum(a{m}_{2 * q + 1})",
                f"    if lane == {i}:",
                f"        a = ta{i}",
                f"        b = tb{i}",
            ]
    return L + [
        f"    if lane < {M * Q}:",
        f"        col = row0 + lane % {Q}",
        f"        if col < N and lane // {Q} < Mx:",
        "            if has_bias:",
        "                a += float32(bias[col])",
        "                b += float32(bias[col + N])",
        f"            out[lane // {Q}, col] = "
        "_silu_mul(round_like(a, out), round_like(b, out), out)",
    ]


def split_k_sum(ks: int, acc: list[str], dead_leave: bool = True) -> list[str]:
    """Split-K (ks > 1), after the K loop: warps 1..ks-1 of a group store their lane sums in
    shared memory and leave after the block's barrier; warp 0 adds them in warp order (the
    same sum in every run) and goes on to the epilogue, as the one warp of ks = 1 does.
    dead_leave: warp 0 of a group past the last row (`live` false) leaves too (a kernel whose
    epilogue guards its writes instead keeps it: fp4_kernels)."""
    leave = "part != 0 or not live" if dead_leave else "part != 0"
    L = [
        f"    red = cuda.shared.array(({WARPS}, {len(acc)}, 32), float32)",
        "    wb = cuda.threadIdx.x >> 5",
        "    if part != 0:",
    ]
    L += [f"        red[wb, {i}, lane] = {a}" for i, a in enumerate(acc)]
    L += ["    cuda.syncthreads()", f"    if {leave}:", "        return"]
    for p in range(1, ks):
        L += [f"    {a} += red[wb + {p}, {i}, lane]" for i, a in enumerate(acc)]
    return L


def source_scope() -> dict:
    """The names the generated dequantizing kernels call (these and moe_quant_decode's)."""
    return {
        "cuda": cuda,
        "float32": float32,
        "uint32": uint32,
        "ld8": ld8,
        "ld_w4": ld_w4,
        "ZERO_W4": ZERO_W4,
        "ZERO8": ZERO8,
        "bits_f32": bits_f32,
        "fold": fold,
        "fold_dot": fold_dot,
        "h2fma": h2fma,
        "h2mul": h2mul,
        "h2f": h2f,
        "ldh8": ldh8,
        "_warp_sum": _warp_sum,
        "_silu_mul": _silu_mul,
        "round_like": round_like,
        "_rot1": _rot1,
    }


@cached_factory
def _build(M: int, R: int, U: int, bits: int, split: bool, kind: str, form: str, ks: int = 1):
    scope = source_scope()
    name = f"<quant gemv {kind} M={M} R={R} U={U} KS={ks} bits={bits} split={split} form={form}>"
    src = _source(M, R, U, bits, split, kind, form, ks)
    exec(compile(src, name, "exec"), scope)  # noqa: S102
    return cuda.jit(scope["kernel"])


_KERNELS: dict[tuple, object] = {}


def qgemv_kernel(
    m: int, bits: int, split: bool = False, kind: str = PLAIN, tile=None, form: str = WEIGHT
):
    """The kernel serving M = m inputs (the next variant's), built once per configuration.
    tile: (R, U) or (R, U, KS) to override tile_for (benchmark sweeps; gate_up needs an even
    R; KS in KS_CHOICES, warps of a block splitting K, any form and kind).
    form: the dot product (`form_for`; FACTORED and HALF2 for fp16 x only)."""
    v = variant_for(m)
    R, U, KS = tiling(v, bits, kind, tile)
    if kind == GATE_UP and R % 2:
        raise ValueError("the gate_up kernel pairs rows: R must be even")
    if kind == QKV_ROPE and R != 2:
        raise ValueError("the qkv_rope kernel owns one rotary pair per warp: R must be 2")
    if split and bits != 4:
        raise ValueError("the SPLIT variant is for int4 codes with group 16")
    if form not in FORMS:
        raise ValueError(f"unknown dot-product form {form!r} (one of {FORMS})")
    if form == HALF2 and (bits != 4 or split):
        raise ValueError("the half2 form is for int4 codes with one group per chunk")
    key = (v, R, U, bits, split, kind, form, KS)
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = _build(v, R, U, bits, split, kind, form, KS)
    return k


FACTORED_MAX_M = 2  # beyond, its per-chunk x work (3 ops per x element and input) costs more
# The half2 form's default range: every M (in the cc 7.0 PTX it needs 0.55-0.6 of the
# per-weight form's instructions at M = 4 and 8 as well, in as many registers or fewer).
HALF2_MAX_M = MAX_M


def form_for(
    m: int, dtype: torch.dtype, bits: int = 4, split: bool = False, force: str | None = None
) -> str:
    """The dot-product form of the M = m launch (dot_step's `form`). fp32 x: always WEIGHT (the
    others read x as fp16). fp16 x: HALF2 for int4 codes with one group per chunk at M <=
    HALF2_MAX_M; else FACTORED at M <= FACTORED_MAX_M (int8, GGUF's split groups: at 4 and 8
    inputs with R = 4 and 2 rows a warp its x work per weight outweighs the integer ops it
    saves); else WEIGHT. force: a form for benchmarks and tests to time or check (HALF2 falls
    back to FACTORED where it does not apply)."""
    if dtype != torch.float16:
        return WEIGHT
    half2_ok = bits == 4 and not split
    if force is not None:
        if force not in FORMS:
            raise ValueError(f"unknown dot-product form {force!r} (one of {FORMS})")
        return FACTORED if force == HALF2 and not half2_ok else force
    v = variant_for(m)
    if half2_ok and v <= HALF2_MAX_M:
        return HALF2
    return FACTORED if v <= FACTORED_MAX_M else WEIGHT


def is_split(w: GroupQuantWeight) -> bool:
    """True when a 16-byte chunk of w's codes spans two groups (int4, group 16)."""
    return w.bits == 4 and w.group_shift == 4


def grid_for(m: int, n: int, bits: int, kind: str = PLAIN, tile=None) -> int:
    """Blocks for n weight rows (plain), n output columns (gate_up) or n rotary pairs: a block
    has WARPS / KS groups of rows (`tiling`), each R rows, R / 2 columns or one pair."""
    R, _, KS = tiling(m, bits, kind, tile)
    per_group = R if kind == PLAIN else R // 2 if kind == GATE_UP else 1
    rows_per_block = WARPS // KS * per_group
    return (n + rows_per_block - 1) // rows_per_block


# Representative instances for `voltserve check-kernels` (kernels/registry.py).
qgemv_int4_m1 = qgemv_kernel(1, 4)
qgemv_int4_m8 = qgemv_kernel(8, 4)
qgemv_int4_split_m1 = qgemv_kernel(1, 4, split=True)
qgemv_int8_m1 = qgemv_kernel(1, 8)
qgemv_gate_up_int4_m1 = qgemv_kernel(1, 4, kind=GATE_UP)
qgemv_gate_up_int4_m8 = qgemv_kernel(8, 4, kind=GATE_UP)
qgemv_qkv_rope_int4_m1 = qgemv_kernel(1, 4, kind=QKV_ROPE)
qgemv_int4_m1_factored = qgemv_kernel(1, 4, form=FACTORED)
qgemv_int4_m1_half2 = qgemv_kernel(1, 4, form=HALF2)
qgemv_int4_m2_half2 = qgemv_kernel(2, 4, form=HALF2)
qgemv_int4_m8_half2 = qgemv_kernel(8, 4, form=HALF2)
qgemv_gate_up_int4_m1_half2 = qgemv_kernel(1, 4, kind=GATE_UP, form=HALF2)
qgemv_qkv_rope_int4_m1_half2 = qgemv_kernel(1, 4, kind=QKV_ROPE, form=HALF2)
# Split-K over the 4 warps of a block (tiling's KS; the default tiles otherwise).
qgemv_int4_m1_half2_ks4 = qgemv_kernel(1, 4, tile=(4, 2, 4), form=HALF2)
qgemv_gate_up_int4_m1_half2_ks4 = qgemv_kernel(1, 4, kind=GATE_UP, tile=(4, 1, 4), form=HALF2)
qgemv_qkv_rope_int4_m1_half2_ks4 = qgemv_kernel(1, 4, kind=QKV_ROPE, tile=(2, 2, 4), form=HALF2)


# ---------------------------------------------------------------------------------------------
# Host side

DTYPES = (torch.float16, torch.float32)


def _aligned(t: torch.Tensor, elems: int) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % elems == 0 for s in t.stride()[:-1])


def supports_weight(w: GroupQuantWeight, dtype: torch.dtype) -> bool:
    """True when the kernel covers w (else quant_linear takes another path)."""
    P = 32 // w.bits
    return (
        on_gpu(w.qweight)
        and dtype in DTYPES
        and w.scales.dtype == dtype
        and w.in_features % (WORDS_PER_CHUNK * P) == 0
        and w.qweight.is_contiguous()
        and w.scales.is_contiguous()
        and w.offsets.is_contiguous()
        and _aligned(w.qweight, 4)
    )


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x, or a fresh contiguous copy when its rows are not 16-byte aligned (a view at an odd
    offset or stride): a few KB at decode, cheaper than any fallback."""
    if on_gpu(x) and x.dim() == 2 and (x.stride(-1) != 1 or not _aligned(x, 8)):
        return x.contiguous() if not x.is_contiguous() else x.clone()
    return x


def supports(x: torch.Tensor, w: GroupQuantWeight) -> bool:
    return (
        on_gpu(x)
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and x.shape[1] == w.in_features
        and x.stride(-1) == 1
        and _aligned(x, 8)
        and supports_weight(w, x.dtype)
    )


def launch_qgemv(
    x, w: GroupQuantWeight, bias, out, kind: str = PLAIN, tile=None, extra=(), form=None
):
    """One launch for inputs `supports` accepted; out None: a new [M, N] (gate_up: [M, N / 2]).
    extra: qkv_rope's arguments after group_shift, already converted. form: None takes
    `form_for`'s choice; a form name forces it (benchmarks and tests; fp32 x stays WEIGHT)."""
    M, rows = x.shape[0], w.out_features
    if out is None:
        cols = rows // 2 if kind == GATE_UP else rows
        out = torch.empty((M, cols), dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    b = bias if has_bias else w.scales.view(-1)  # any 1-D array of the dtype; unread
    launch(
        qgemv_kernel(
            M, w.bits, is_split(w), kind, tile, form_for(M, x.dtype, w.bits, is_split(w), form)
        ),
        grid_for(M, rows if kind == PLAIN else rows // 2, w.bits, kind, tile),
        THREADS,
        (
            x,
            w.qweight,
            w.scales,
            w.offsets,
            b,
            out,
            has_bias,
            w.group_shift,
            *extra,
        ),
        current_stream(),
    )
    return out


def quant_gemv_cuda(
    x, w: GroupQuantWeight, bias=None, out=None, tile=None, form=None
) -> torch.Tensor:
    """quant_linear_ref's meaning for x of 1..8 rows (already permuted by the caller); what
    `supports` rejects goes to the reference. No host sync: graph-capturable. form: see
    launch_qgemv."""
    x = _aligned_rows(x)
    if not supports(x, w):
        from voltserve.kernels.linear.quant_pack import dequantize

        y = torch.nn.functional.linear(x, dequantize(w, x.dtype), bias)
        return y if out is None else out.copy_(y)
    return launch_qgemv(x, w, bias, out, PLAIN, tile, form=form)


def quant_gemv_gate_up_cuda(x, w: GroupQuantWeight, bias=None, out=None, tile=None, form=None):
    """silu_and_mul(x @ dequantize(w)^T (+ bias)) for a merged gate_up weight [2I, K] and x of
    1..8 rows (already permuted); one launch."""
    x = _aligned_rows(x)
    if w.out_features % 2 or not supports(x, w):
        from voltserve.kernels.elementwise.activation import silu_and_mul_ref
        from voltserve.kernels.linear.quant_pack import dequantize

        y = silu_and_mul_ref(torch.nn.functional.linear(x, dequantize(w, x.dtype), bias))
        return y if out is None else out.copy_(y)
    return launch_qgemv(x, w, bias, out, GATE_UP, tile, form=form)


def quant_qkv_rope_ref(
    x,
    w: GroupQuantWeight,
    bias,
    positions,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    n_q: int,
    n_kv: int,
    out=None,
) -> torch.Tensor:
    """gemv_qkv_rope_ref's meaning with a quantized qkv weight: quant_linear_ref, then NeoX
    rotary on q and k and the KV-cache write (rotary_cache.rotary_and_cache_ref); x already
    permuted. Returns qkv [M, N]."""
    from voltserve.kernels.attention.rotary_cache import rotary_and_cache_ref
    from voltserve.kernels.linear.quant_pack import dequantize

    y = torch.nn.functional.linear(x, dequantize(w, x.dtype), bias)
    out = y if out is None else out.copy_(y)
    D = k_cache.shape[3]
    q, k, v = out.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    rotary_and_cache_ref(positions, q, k, v, D, cos_sin_cache, True, k_cache, v_cache, slot_mapping)
    return out


def supports_qkv_rope(
    x,
    w: GroupQuantWeight,
    positions,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    n_q: int,
    n_kv: int,
) -> bool:
    """When the fused kernel computes this step (the checks of gemv_qkv_rope.supports_qkv_rope
    with a quantized weight)."""
    M = x.shape[0] if x.dim() == 2 else 0
    return (
        supports(x, w)
        and k_cache.dim() == 4
        and k_cache.shape == v_cache.shape
        and k_cache.shape[1] == n_kv
        and k_cache.shape[3] % 2 == 0
        and w.out_features == (n_q + 2 * n_kv) * k_cache.shape[3]
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.shape[1] == k_cache.shape[3]
        and cos_sin_cache.dtype == torch.float32
        and k_cache.dtype == x.dtype
        and v_cache.dtype == x.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and positions.dtype == torch.int64
        and slot_mapping.dtype == torch.int64
        and positions.dim() == 1
        and slot_mapping.dim() == 1
        and positions.shape[0] >= M
        and slot_mapping.shape[0] >= M
    )


def quant_qkv_rope_cuda(
    x,
    w: GroupQuantWeight,
    bias,
    positions,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    n_q: int,
    n_kv: int,
    out=None,
    form=None,
    tile=None,
) -> torch.Tensor:
    """quant_qkv_rope_ref's meaning in one launch (x of 1..8 rows, already permuted); what
    `supports_qkv_rope` rejects runs the reference. No host sync. form: see launch_qgemv;
    tile: (2, U) or (2, U, KS) to override tile_for (tests and benchmarks)."""
    x = _aligned_rows(x)
    args = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping, n_q, n_kv)
    if not supports_qkv_rope(x, w, *args):
        return quant_qkv_rope_ref(x, w, bias, *args, out=out)
    extra = (
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        int(n_q),
        int(n_kv),
    )
    return launch_qgemv(x, w, bias, out, QKV_ROPE, tile, extra, form=form)


__all__ = [
    "quant_qkv_rope_ref",
    "quant_qkv_rope_cuda",
    "supports_qkv_rope",
    "qgemv_kernel",
    "form_for",
    "tile_for",
    "tiling",
    "grid_for",
    "supports",
    "supports_weight",
    "quant_gemv_cuda",
    "quant_gemv_gate_up_cuda",
]
