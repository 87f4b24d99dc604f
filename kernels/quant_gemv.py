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

Groups: a 16-byte chunk of codes starts at a multiple of 32 (int4) / 16 (int8) inputs, so for
group sizes >= 32 (int4) / >= 16 (int8) it lies in one group: one (scale, offset) per chunk per
row. int4 with group 16 (GGUF K-quant sub-blocks) is the SPLIT variant: words 0-1 and 2-3 of a
chunk take consecutive groups. Per-channel weights (g = K) have group_shift 30: every k maps to
group 0.

The gate_up variant (kind GATE_UP) owns gate row j and up row I + j in one warp and writes
silu_and_mul's h[m, j], rounded as the unfused path rounds (the product to the storage dtype,
silu, then the product), like gemv.py's.

Requirements (checked on the host by `supports`, otherwise quant_linear takes another path):
K a multiple of 32 (int4) / 16 (int8) so chunks are whole 16-byte words; qweight, x and out
16-byte aligned with unit last stride. Every chunk load is guarded (zeros past K: one body for
full and partial steps); a partial last group of rows re-reads row N - 1 and does not write it.

M, R, U, bits and SPLIT are compile-time constants of a generated kernel (one per combination,
built on first use), so accumulators and in-flight words stay in registers.
"""

from __future__ import annotations

import torch
from numba import cuda, uint32
from voltserve.kernels.activation import _silu_mul
from voltserve.kernels.gemv import _warp_sum
from voltserve.kernels.numba_common import current_stream, dev, float32, launch, round_like
from voltserve.kernels.quant_common import ZERO_W4, bits_f32, code_bit, code_f_expr, fold, ld_w4
from voltserve.kernels.quant_pack import GroupQuantWeight
from voltserve.kernels.vec_io import ZERO8, ld8

MAX_M = 8
WARPS = 4
THREADS = 32 * WARPS
WORDS_PER_CHUNK = 4  # 16 bytes
WARP_WORDS = 32 * WORDS_PER_CHUNK  # code words a warp reads per chunk (128)
VARIANTS = (1, 2, 4, 8)
PLAIN, GATE_UP = "plain", "gate_up"


def variant_for(m: int) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"quantized gemv kernels cover M = 1..{MAX_M}, got {m}")
    return next(v for v in VARIANTS if v >= m)


def tile_for(m: int, bits: int, kind: str = PLAIN) -> tuple[int, int]:
    """(R rows per warp, U chunks per lane per step). R * U 16-byte loads are in flight per lane
    (4 for int4: 32 codes a chunk make a step 4x the inputs of fp16's, and the generated body,
    R * U * 32 * M multiply-adds, must stay small enough to compile). x costs ~4 bytes of L1
    traffic per weight byte per input row (fp16 x, half-byte codes) divided by R, so R grows
    with M. gate_up: the pair (gate j, up I + j)."""
    if kind == GATE_UP:
        return (2, 2) if m <= 2 else (2, 1)
    if m == 1:
        return (1, 4)
    if m == 2:
        return (2, 2)
    return (4, 1) if bits == 4 or m == 8 else (2, 2)


@cuda.jit(device=True, inline="always")
def _ldw_guard(qw, row, col, W):
    if col < W:
        return ld_w4(qw, (row, col))
    return ZERO_W4


@cuda.jit(device=True, inline="always")
def _ldx_guard(x, row, col, K):
    if col < K:
        return ld8(x, (row, col))
    return ZERO8


def _source(M: int, R: int, U: int, bits: int, split: bool, kind: str) -> str:
    """One kernel, written out statement by statement (see gemv._source for why)."""
    gate_up = kind == GATE_UP
    P = 32 // bits  # codes per word
    acc = [f"a{m}_{r}" for m in range(M) for r in range(R)]
    step = U * WARP_WORDS  # words per step
    L = [
        "def kernel(x, qw, scales, offsets, bias, out, has_bias, gshift):",
        "    lane = cuda.threadIdx.x & 31",
        "    warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> 5",
        "    K = x.shape[1]",
        "    W = qw.shape[1]",
        "    G = scales.shape[1]",
    ]
    if gate_up:
        L += [
            "    N = qw.shape[0] >> 1",
            "    row0 = warp",
            "    if row0 >= N:",
            "        return",
            "    rw0 = row0",
            "    rw1 = row0 + N",
        ]
    else:
        L += [
            "    N = qw.shape[0]",
            f"    row0 = warp * {R}",
            "    if row0 >= N:",
            "        return  # the whole warp leaves together: the shuffles stay full-mask",
        ]
        L += [f"    rw{r} = min(row0 + {r}, N - 1)" for r in range(R)]
    L.append("    Mx = x.shape[0]")
    L += [f"    xm{m} = min({m}, Mx - 1)" for m in range(1, M)]
    L += [f"    {a} = float32(0.0)" for a in acc]
    L += [f"    lw = lane * {WORDS_PER_CHUNK}", "    w0 = 0"]

    def body(ind: str, guarded: bool = True) -> list[str]:
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
                    out.append(f"{ind}q{r}_{j} = _ldw_guard(qw, rw{r}, c{j}, W)")
                else:
                    out.append(f"{ind}q{r}_{j} = ld_w4(qw, (rw{r}, c{j}))")
        for r in range(R):
            for j in range(U):
                out.append(f"{ind}s{r}_{j} = scales[rw{r}, g{j}]")
                out.append(f"{ind}o{r}_{j} = offsets[rw{r}, g{j}]")
                if split:
                    out.append(f"{ind}t{r}_{j} = scales[rw{r}, h{j}]")
                    out.append(f"{ind}p{r}_{j} = offsets[rw{r}, h{j}]")
        for j in range(U):
            for r in range(R):
                out.append(f"{ind}S{r}, O{r} = fold(s{r}_{j}, o{r}_{j}, {1 << bits})")
                if split:
                    out.append(f"{ind}T{r}, Q{r} = fold(t{r}_{j}, p{r}_{j}, {1 << bits})")
            # 8 inputs per x load: one word of int4 codes, two words of int8.
            n_x = WORDS_PER_CHUNK * P // 8
            for t in range(n_x):
                col = f"(c{j} + {t * 8 // P}) * {P}"
                for m in range(M):
                    xm = f"xm{m}" if m else "0"
                    if guarded:
                        out.append(f"{ind}xv{m} = _ldx_guard(x, {xm}, {col}, K)")
                    else:
                        out.append(f"{ind}xv{m} = ld8(x, ({xm}, {col}))")
                for e in range(8):
                    word = t * 8 // P + e // P  # word of the chunk holding input e
                    p = code_bit(e % P, bits)
                    sc, of = ("T", "Q") if split and word >= 2 else ("S", "O")
                    for r in range(R):
                        f = code_f_expr(f"q{r}_{j}[{word}]", p, bits)
                        out.append(f"{ind}wv = {f} * {sc}{r} + {of}{r}")
                        for m in range(M):
                            out.append(f"{ind}a{m}_{r} += xv{m}[{e}] * wv")
        return out

    # One guarded body (a compare per 16-byte load): half the code of a separate tail step.
    L.append("    while w0 < W:")
    L += body("        ")
    L.append(f"        w0 += {step}")
    if gate_up:
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
            "        out[lane, row0] = _silu_mul(round_like(a, out), round_like(b, out), out)",
        ]
        return "\n".join(L) + "\n"
    L.append("    mine = float32(0.0)")
    for i, a in enumerate(acc):
        L += [f"    t = _warp_sum({a})", f"    if lane == {i}:", "        mine = t"]
    L += [
        f"    if lane < {M * R}:",
        f"        row = row0 + lane % {R}",
        f"        if row < N and lane // {R} < Mx:",
        "            if has_bias:",
        "                mine += float32(bias[row])",
        f"            out[lane // {R}, row] = mine",
    ]
    return "\n".join(L) + "\n"


def _build(M: int, R: int, U: int, bits: int, split: bool, kind: str):
    scope = {
        "cuda": cuda,
        "float32": float32,
        "uint32": uint32,
        "ld8": ld8,
        "ld_w4": ld_w4,
        "_ldw_guard": _ldw_guard,
        "_ldx_guard": _ldx_guard,
        "bits_f32": bits_f32,
        "fold": fold,
        "_warp_sum": _warp_sum,
        "_silu_mul": _silu_mul,
        "round_like": round_like,
    }
    name = f"<quant gemv {kind} M={M} R={R} U={U} bits={bits} split={split}>"
    exec(compile(_source(M, R, U, bits, split, kind), name, "exec"), scope)  # noqa: S102
    return cuda.jit(scope["kernel"])


_KERNELS: dict[tuple, object] = {}


def qgemv_kernel(m: int, bits: int, split: bool = False, kind: str = PLAIN, tile=None):
    """The kernel serving M = m inputs (the next variant's), built once per configuration.
    tile: (R, U) to override tile_for (benchmark sweeps; gate_up needs R = 2)."""
    v = variant_for(m)
    R, U = tile if tile is not None else tile_for(v, bits, kind)
    if kind == GATE_UP and R != 2:
        raise ValueError("the gate_up kernel pairs rows: R must be 2")
    if split and bits != 4:
        raise ValueError("the SPLIT variant is for int4 codes with group 16")
    key = (v, R, U, bits, split, kind)
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = _build(v, R, U, bits, split, kind)
    return k


def is_split(w: GroupQuantWeight) -> bool:
    """True when a 16-byte chunk of w's codes spans two groups (int4, group 16)."""
    return w.bits == 4 and w.group_shift == 4


def grid_for(m: int, n: int, bits: int, kind: str = PLAIN, tile=None) -> int:
    """Blocks for n weight rows (plain) or n row pairs (gate_up)."""
    R, _ = tile if tile is not None else tile_for(variant_for(m), bits, kind)
    rows_per_block = WARPS * (R if kind == PLAIN else 1)
    return (n + rows_per_block - 1) // rows_per_block


# Representative instances for `voltserve check-kernels` (kernels/registry.py).
qgemv_int4_m1 = qgemv_kernel(1, 4)
qgemv_int4_m2 = qgemv_kernel(2, 4)
qgemv_int4_m4 = qgemv_kernel(4, 4)
qgemv_int4_m8 = qgemv_kernel(8, 4)
qgemv_int4_split_m1 = qgemv_kernel(1, 4, split=True)
qgemv_int4_split_m8 = qgemv_kernel(8, 4, split=True)
qgemv_int8_m1 = qgemv_kernel(1, 8)
qgemv_int8_m8 = qgemv_kernel(8, 8)
qgemv_gate_up_int4_m1 = qgemv_kernel(1, 4, kind=GATE_UP)
qgemv_gate_up_int4_m8 = qgemv_kernel(8, 4, kind=GATE_UP)
qgemv_gate_up_int8_m1 = qgemv_kernel(1, 8, kind=GATE_UP)


# ---------------------------------------------------------------------------------------------
# Host side

DTYPES = (torch.float16, torch.float32)


def _aligned(t: torch.Tensor, elems: int) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % elems == 0 for s in t.stride()[:-1])


def supports_weight(w: GroupQuantWeight, dtype: torch.dtype) -> bool:
    """True when the kernel covers w (else quant_linear takes another path)."""
    P = 32 // w.bits
    return (
        w.qweight.is_cuda
        and dtype in DTYPES
        and w.scales.dtype == dtype
        and w.in_features % (WORDS_PER_CHUNK * P) == 0
        and w.qweight.is_contiguous()
        and w.scales.is_contiguous()
        and w.offsets.is_contiguous()
        and _aligned(w.qweight, 4)
    )


def supports(x: torch.Tensor, w: GroupQuantWeight) -> bool:
    return (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and x.shape[1] == w.in_features
        and x.stride(-1) == 1
        and _aligned(x, 8)
        and supports_weight(w, x.dtype)
    )


def launch_qgemv(x, w: GroupQuantWeight, bias, out, kind: str = PLAIN, tile=None):
    """One launch for inputs `supports` accepted; out None: a new [M, N] (gate_up: [M, N / 2])."""
    M, rows = x.shape[0], w.out_features
    if out is None:
        cols = rows // 2 if kind == GATE_UP else rows
        out = torch.empty((M, cols), dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    b = bias if has_bias else w.scales[:, 0]  # any 1-D array of the dtype; unread without bias
    launch(
        qgemv_kernel(M, w.bits, is_split(w), kind, tile),
        grid_for(M, rows if kind == PLAIN else rows // 2, w.bits, kind, tile),
        THREADS,
        (
            dev(x),
            dev(w.qweight),
            dev(w.scales),
            dev(w.offsets),
            dev(b),
            dev(out),
            has_bias,
            w.group_shift,
        ),
        current_stream(),
    )
    return out


def quant_gemv_cuda(x, w: GroupQuantWeight, bias=None, out=None, tile=None) -> torch.Tensor:
    """quant_linear_ref's meaning for x of 1..8 rows (already permuted by the caller); what
    `supports` rejects goes to the reference. No host sync: graph-capturable."""
    if not supports(x, w):
        from voltserve.kernels.quant_pack import dequantize

        y = torch.nn.functional.linear(x, dequantize(w, x.dtype), bias)
        return y if out is None else out.copy_(y)
    return launch_qgemv(x, w, bias, out, PLAIN, tile)


def quant_gemv_gate_up_cuda(x, w: GroupQuantWeight, bias=None, out=None, tile=None):
    """silu_and_mul(x @ dequantize(w)^T (+ bias)) for a merged gate_up weight [2I, K] and x of
    1..8 rows (already permuted); one launch."""
    if w.out_features % 2 or not supports(x, w):
        from voltserve.kernels.activation import silu_and_mul_ref
        from voltserve.kernels.quant_pack import dequantize

        y = silu_and_mul_ref(torch.nn.functional.linear(x, dequantize(w, x.dtype), bias))
        return y if out is None else out.copy_(y)
    return launch_qgemv(x, w, bias, out, GATE_UP, tile)


__all__ = [
    "qgemv_kernel",
    "tile_for",
    "grid_for",
    "supports",
    "supports_weight",
    "quant_gemv_cuda",
    "quant_gemv_gate_up_cuda",
]
