"""Decode GEMV (1..8 rows) that reads GGUF K-quant blocks as stored (kquant_pack.py):
y[M, N] = x[M, K] @ dequantize_kquant(w)^T (+ bias), fp16 x, fp32 accumulation, cc 7.0 features
(no cp.async). Q4_K reads 4.5 bits a weight and Q6_K 6.56, where the group-quantized path reads
Q4_K's codes with two fp32 per 32 weights (6 bits) and Q6_K widened to 8-bit codes.

Work. A warp owns R consecutive weight rows; a step of the warp covers 8 ggml blocks (2,048
inputs) of each, four lanes a block, every lane 64 weights of every row:

- Q4_K: lane c of a block takes qs chunk c (bytes 32c .. 32c + 31: sub-block 2c in the low
  nibbles, 2c + 1 in the high ones) as two 16-byte loads, and the block's 16-byte head (d, dmin,
  scales[12]) as one more (the four lanes of a block load the same head: one transaction). Its two
  six-bit scales and mins are decoded from the head with a few word-wide masks (the
  get_scale_min_k4 rule on four bytes at once), once per 32 weights.
- Q6_K: lane (n, h) of a block takes half n, elements 16h .. 16h + 15 of each of its four
  quarters: ql bytes 64n + 16h and 64n + 32 + 16h and qh bytes 32n + 16h (three 16-byte
  loads), and its four int8 scales and the block's d (scalar loads shared by the block's lanes).

Every load of a step (R rows x 3) is issued before the first use. x is read as 16-byte half2
loads next to its use (L1/L2 hits), each shared by the R rows.

Dot product, the half2 form of quant_gemv (see its module doc for the precision argument): a
code pair becomes the exact half2 (c - centre) * 2**-e with one LOP3 (plus a shift and, for
Q6_K, the two high bits ORed in) and one fma.f16x2 through the 0x6400 magic; one fma.f16x2 then
adds two products of a run (16 terms a half for a Q4_K sub-block, 8 for a Q6_K quarter),
widened to fp32 once per run and scaled by the sub-block's fp32 scale. The codes' byte order
pairs elements (l, l + 2) in a word's halves; one `prmt` a word regroups them to (l, l + 1),
the order of x's half2 pairs. Q4_K's minimum enters through the x sums (sum_k x_k (s q_k - m) =
s sum_k x_k (q_k - 8) + (8 s - m) sum_k x_k, the x sums an fp16 run of 16 a half as well).
Q6_K is symmetric: no x sums. Ranges: Q4_K's runs are quant_gemv's (2**-8 units); Q6_K's codes
are scaled by 2**-10, so a run of 8 products stays below 8 * 32 * 65504 * 2**-10 = 16376.

Split-K (KS warps of a block on the same rows, interleaved steps, sums added through shared
memory by warp 0 in warp order: deterministic), for weights whose rows are too few to fill the
GPU (`split_for`; not yet measured, `tile` overrides it).

Requirements (`supports`): fp16 x of 1..8 rows, K a multiple of 256, the block bytes, x and out
16-byte aligned with unit last stride. Anything else runs the reference.
"""

from __future__ import annotations

import torch
from numba import cuda
from voltserve.kernels.linear.gemv import _warp_sum
from voltserve.kernels.linear.kquant_pack import QK_K, KQuantWeight
from voltserve.kernels.linear.quant_common import ld_w4
from voltserve.kernels.linear.quant_gemv import (
    H2_HI_ADD,
    H2_HI_MUL,
    H2_LO_ADD,
    H2_LO_MUL,
    H2_MAGIC,
    H2_MASK_HI,
    H2_MASK_LO,
    H2_X,
)
from voltserve.kernels.runtime.compile_cache import cached_factory
from voltserve.kernels.runtime.half2 import h2_bits, h2f, h2fma, h2mul, ldh8, prmt
from voltserve.kernels.runtime.launch_geometry import on_gpu, sm_count
from voltserve.kernels.runtime.numba_common import current_stream, float32, launch, named_kernel

MAX_M = 8
VARIANTS = (1, 2, 4, 8)
WARPS = 4
THREADS = 32 * WARPS
BLOCKS_PER_STEP = 8  # ggml blocks a warp step covers (4 lanes each)
STEP_INPUTS = BLOCKS_PER_STEP * QK_K
KS_CHOICES = (1, 2, 4)
NATIVE = ("Q4_K", "Q6_K")  # the types with a GEMV here
WORDS = {"Q4_K": 36, "Q6_K": 48}  # int32 words a block's `blocks` bytes take
PAIRS = 0x3120  # prmt selector: bytes (0, 2, 1, 3), so each half holds elements (l, l + 1)
# Q6_K: (1024 + q) * 2**-10 - 1056 / 1024 = (q - 32) * 2**-10, exact in fp16
Q6_MUL, Q6_ADD = h2_bits(2.0**-10, 2.0**-10), h2_bits(-1056 / 1024, -1056 / 1024)
Q6_HIGH = 0x00300030  # bits 4..5 of each half: a code's two high bits
DEFAULT_R = 2  # rows a warp: each x load serves two rows; half the warps of R = 4


def variant_for(m: int) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"K-quant gemv kernels cover M = 1..{MAX_M}, got {m}")
    return next(v for v in VARIANTS if v >= m)


def _head(M: int, R: int, KS: int, args: str) -> list[str]:
    """Kernel start: the warp's rows rw{r}, its share of the steps, zeroed accumulators."""
    L = [
        f"def kernel({args}):",
        "    lane = cuda.threadIdx.x & 31",
        "    wib = cuda.threadIdx.x >> 5",
        f"    group = cuda.blockIdx.x * {WARPS // KS} + wib // {KS}",
        f"    part = wib % {KS}",
        "    N = out.shape[1]",
        f"    row0 = group * {R}",
        "    live = row0 < N",
    ]
    if KS == 1:
        L += ["    if not live:", "        return  # the whole warp: its shuffles stay full-mask"]
    L += [
        "    Mx = x.shape[0]",
        f"    NB = x.shape[1] // {QK_K}",
        f"    steps = (NB + {BLOCKS_PER_STEP - 1}) // {BLOCKS_PER_STEP}",
        "    if not live:",
        "        steps = 0",
        "    bl = lane >> 2",
        "    c = lane & 3",
    ]
    L += ["    xm0 = 0"] + [f"    xm{m} = min({m}, Mx - 1)" for m in range(1, M)]
    L += [f"    rw{r} = min(row0 + {r}, N - 1)" for r in range(R)]
    L += [f"    a{m}_{r} = float32(0.0)" for m in range(M) for r in range(R)]
    L += [
        f"    for s in range(part, steps, {KS}):",
        f"        b = s * {BLOCKS_PER_STEP} + bl",
        "        if b < NB:",
    ]
    return L


def _run(ind: str, name: str, xs: list[str], ks: list[str]) -> list[str]:
    """name = the half2 run of x pairs xs times code pairs ks (one fma.f16x2 each)."""
    out = [f"{ind}{name} = h2mul({xs[0]}, {ks[0]})"]
    out += [f"{ind}{name} = h2fma({a}, {k}, {name})" for a, k in zip(xs[1:], ks[1:])]
    return out


def _x_words(ind: str, name: str, xm: str, col: str, loads: int) -> tuple[list[str], list[str]]:
    """`loads` 16-byte x loads from column col: the statements and the 4 * loads half2 words."""
    L = [f"{ind}{name}{t} = ldh8(x, ({xm}, {col} + {8 * t}))" for t in range(loads)]
    return L, [f"{name}{t}[{p}]" for t in range(loads) for p in range(4)]


def _q4k_body(M: int, R: int) -> list[str]:
    ind = " " * 12
    L = [f"{ind}wb = b * {WORDS['Q4_K']}", f"{ind}wq = wb + 4 + 8 * c"]
    for r in range(R):
        L += [
            f"{ind}h{r} = ld_w4(qw, (rw{r}, wb))",
            f"{ind}p{r} = ld_w4(qw, (rw{r}, wq))",
            f"{ind}q{r} = ld_w4(qw, (rw{r}, wq + 4))",
        ]
    L += [f"{ind}xk = b * {QK_K} + c * 64", f"{ind}sh = (c & 1) * 16"]
    for r in range(R):
        # get_scale_min_k4 on four sub-blocks at once: chunks 0-1 read the low six bits of
        # scales[0..3] / [4..7]; chunks 2-3 the low nibbles of scales[8..11] (mins: high
        # nibbles) under the top two bits of scales[0..3] (mins: [4..7])
        L += [
            f"{ind}dd{r}, dm{r} = h2f(h{r}[0])",
            f"{ind}if c < 2:",
            f"{ind}    sw{r} = h{r}[1] & 0x3F3F3F3F",
            f"{ind}    mw{r} = h{r}[2] & 0x3F3F3F3F",
            f"{ind}else:",
            f"{ind}    sw{r} = (h{r}[3] & 0x0F0F0F0F) | ((h{r}[1] >> 2) & 0x30303030)",
            f"{ind}    mw{r} = ((h{r}[3] >> 4) & 0x0F0F0F0F) | ((h{r}[2] >> 2) & 0x30303030)",
            f"{ind}fa{r} = dd{r} * float32((sw{r} >> sh) & 63)",
            f"{ind}fb{r} = dd{r} * float32((sw{r} >> (sh + 8)) & 63)",
            f"{ind}FA{r} = fa{r} * float32(256.0)",
            f"{ind}FB{r} = fb{r} * float32(256.0)",
            f"{ind}GA{r} = (fa{r} * float32(8.0) - dm{r} * float32((mw{r} >> sh) & 63))"
            " * float32(256.0)",
            f"{ind}GB{r} = (fb{r} * float32(8.0) - dm{r} * float32((mw{r} >> (sh + 8)) & 63))"
            " * float32(256.0)",
        ]
        for i in range(8):
            word = f"p{r}[{i}]" if i < 4 else f"q{r}[{i - 4}]"
            u = f"u{r}_{i}"
            L += [f"{ind}{u} = prmt({word}, {PAIRS:#x})", f"{ind}v{r}_{i} = {u} >> 8"]
    # one sub-block at a time (A: low nibbles, B: high), so only its code pairs are live
    for sub, off, mask, mul, add in (
        ("A", 0, H2_MASK_LO, H2_LO_MUL, H2_LO_ADD),
        ("B", 32, H2_MASK_HI, H2_HI_MUL, H2_HI_ADD),
    ):
        for r in range(R):
            for i in range(8):
                for t, w in enumerate((f"u{r}_{i}", f"v{r}_{i}")):
                    L.append(
                        f"{ind}k{sub}{r}_{2 * i + t} = h2fma(({w} & {mask:#x}) | {H2_MAGIC:#x},"
                        f" {mul:#x}, {add:#x})"
                    )
        for m in range(M):
            xl, xw = _x_words(ind, f"x{sub}{m}_", f"xm{m}", f"xk + {off}", 4)
            L += xl
            L += _run(ind, f"sx{sub}{m}", xw, [f"{H2_X:#x}"] * 16)
            L += [
                f"{ind}sl{sub}{m}, su{sub}{m} = h2f(sx{sub}{m})",
                f"{ind}xs{sub}{m} = sl{sub}{m} + su{sub}{m}",
            ]
            for r in range(R):
                hh = f"hh{sub}{m}_{r}"
                L += _run(ind, hh, xw, [f"k{sub}{r}_{j}" for j in range(16)])
                L += [
                    f"{ind}hl{sub}{m}_{r}, hu{sub}{m}_{r} = h2f({hh})",
                    f"{ind}a{m}_{r} += (hl{sub}{m}_{r} + hu{sub}{m}_{r}) * F{sub}{r}"
                    f" + xs{sub}{m} * G{sub}{r}",
                ]
    return L


# Q6_K quarter j of a lane's 16 elements: (ql word, its nibble shift for elements (l, l + 1),
# the qh shift that brings their two high bits to bits 4..5: left when positive)
_Q6_QUARTERS = ((1, 0, 4), (2, 0, 2), (1, 4, 0), (2, 4, -2))


def _shift(w: str, n: int) -> str:
    if n > 0:
        return f"({w} << {n})"
    return f"({w} >> {-n})" if n < 0 else w


def _q6k_body(M: int, R: int) -> list[str]:
    ind = " " * 12
    L = [
        f"{ind}wb = b * {WORDS['Q6_K']}",
        f"{ind}hn = c >> 1",
        f"{ind}hl = c & 1",
        f"{ind}w1 = wb + 16 * hn + 4 * hl",
        f"{ind}wh = wb + 32 + 8 * hn + 4 * hl",
        f"{ind}sb = b * 16 + 8 * hn + hl",
    ]
    for r in range(R):
        L += [
            f"{ind}l1_{r} = ld_w4(qw, (rw{r}, w1))",
            f"{ind}l2_{r} = ld_w4(qw, (rw{r}, w1 + 8))",
            f"{ind}qh{r} = ld_w4(qw, (rw{r}, wh))",
        ]
        L += [f"{ind}sc{r}_{j} = scales[rw{r}, sb + {2 * j}]" for j in range(4)]
        L.append(f"{ind}dq{r} = float32(dd[rw{r}, b]) * float32(1024.0)")
    L.append(f"{ind}xk = b * {QK_K} + hn * 128 + hl * 16")
    for r in range(R):
        L += [f"{ind}F{r}_{j} = dq{r} * float32(sc{r}_{j})" for j in range(4)]
        for i in range(4):
            L += [
                f"{ind}ua{r}_{i} = prmt(l1_{r}[{i}], {PAIRS:#x})",
                f"{ind}ub{r}_{i} = prmt(l2_{r}[{i}], {PAIRS:#x})",
                f"{ind}vh{r}_{i} = prmt(qh{r}[{i}], {PAIRS:#x})",
            ]
    # one quarter at a time, so only its code pairs are live
    for j, (src, nib, hs) in enumerate(_Q6_QUARTERS):
        for r in range(R):
            for i in range(4):
                u = f"u{'a' if src == 1 else 'b'}{r}_{i}"
                for t in range(2):  # elements (l, l + 1), then (l + 2, l + 3): 8 bits on
                    lo = f"(({_shift(u, -(nib + 8 * t))} & {H2_MASK_LO:#x})"
                    hi = f"({_shift(f'vh{r}_{i}', hs - 8 * t)} & {Q6_HIGH:#x})"
                    L.append(
                        f"{ind}k{j}_{r}_{2 * i + t} = h2fma({lo} | {hi}) | {H2_MAGIC:#x},"
                        f" {Q6_MUL:#x}, {Q6_ADD:#x})"
                    )
        for m in range(M):
            xl, xw = _x_words(ind, f"x{j}_{m}_", f"xm{m}", f"xk + {32 * j}", 2)
            L += xl
            for r in range(R):
                hh = f"hh{j}_{m}_{r}"
                L += _run(ind, hh, xw, [f"k{j}_{r}_{e}" for e in range(8)])
                L += [
                    f"{ind}hl{j}_{m}_{r}, hu{j}_{m}_{r} = h2f({hh})",
                    f"{ind}a{m}_{r} += (hl{j}_{m}_{r} + hu{j}_{m}_{r}) * F{r}_{j}",
                ]
    return L


def _tail(M: int, R: int, KS: int) -> list[str]:
    acc = [f"a{m}_{r}" for m in range(M) for r in range(R)]
    L = []
    if KS > 1:
        # warps 1..KS-1 of a group hand their lane sums to warp 0, which adds them in order
        L += [
            f"    red = cuda.shared.array(({WARPS}, {len(acc)}, 32), float32)",
            "    if part != 0:",
        ]
        L += [f"        red[wib, {i}, lane] = {a}" for i, a in enumerate(acc)]
        L += ["    cuda.syncthreads()", "    if part != 0 or not live:", "        return"]
        for p in range(1, KS):
            L += [f"    {a} += red[wib + {p}, {i}, lane]" for i, a in enumerate(acc)]
    L.append("    mine = float32(0.0)")
    for i, a in enumerate(acc):
        L += [f"    t{i} = _warp_sum({a})", f"    if lane == {i}:", f"        mine = t{i}"]
    L += [
        f"    if lane < {M * R}:",
        f"        row = row0 + lane % {R}",
        f"        m = lane // {R}",
        "        if row < N and m < Mx:",
        "            if has_bias:",
        "                mine += float32(bias[row])",
        "            out[m, row] = mine",
    ]
    return L


def _source(kind: str, M: int, R: int, KS: int) -> str:
    if kind == "Q4_K":
        args = "x, qw, bias, out, has_bias"
        body = _q4k_body(M, R)
    else:
        args = "x, qw, scales, dd, bias, out, has_bias"
        body = _q6k_body(M, R)
    return "\n".join(_head(M, R, KS, args) + body + _tail(M, R, KS)) + "\n"


_KERNELS: dict[tuple, object] = {}


def kquant_kernel(kind: str, m: int, R: int = DEFAULT_R, KS: int = 1):
    """The GEMV of `kind` serving m input rows (its variant's), built once per configuration."""
    if kind not in NATIVE:
        raise ValueError(f"no K-quant GEMV for {kind} (have {NATIVE})")
    if KS not in KS_CHOICES or R < 1:
        raise ValueError(f"split-K over {KS} warps / {R} rows a warp: KS in {KS_CHOICES}")
    key = (kind, variant_for(m), R, KS)
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = _build(*key)
    return k


@cached_factory
def _build(kind: str, M: int, R: int, KS: int):
    scope = {
        "cuda": cuda,
        "float32": float32,
        "ld_w4": ld_w4,
        "ldh8": ldh8,
        "h2fma": h2fma,
        "h2mul": h2mul,
        "h2f": h2f,
        "prmt": prmt,
        "_warp_sum": _warp_sum,
    }
    label = f"<kquant gemv {kind} M={M} R={R} KS={KS}>"
    exec(compile(_source(kind, M, R, KS), label, "exec"), scope)  # noqa: S102
    name = f"kquant_gemv_{kind.lower()}_m{M}_r{R}_ks{KS}"
    return cuda.jit(named_kernel(scope["kernel"], __name__, name))


def split_for(groups: int, steps: int, sms: int) -> int:
    """Split-K warps per row group: while the groups fill fewer than 8 warps an SM and each share
    keeps at least two steps, double KS (up to 4). Not yet measured."""
    ks = 1
    while ks < KS_CHOICES[-1] and groups * ks < 8 * sms and steps >= 4 * ks:
        ks *= 2
    return ks


def tiling(w: KQuantWeight, device, tile=None) -> tuple[int, int]:
    """(R, KS) of a launch: tile when given (benchmarks and tests), else DEFAULT_R and
    split_for's KS at the device's SM count."""
    if tile is not None:
        return tile
    groups = -(-w.out_features // DEFAULT_R)
    steps = -(-w.nblocks // BLOCKS_PER_STEP)
    return DEFAULT_R, split_for(groups, steps, sm_count(device))


def grid_for(n: int, R: int, KS: int) -> int:
    groups = -(-n // R)
    per_block = WARPS // KS
    return -(-groups // per_block)


# Representative instances for `voltserve check-kernels` (kernels/registry.py).
kquant_gemv_q4_k_m1 = kquant_kernel("Q4_K", 1)
kquant_gemv_q6_k_m1 = kquant_kernel("Q6_K", 1)
kquant_gemv_q6_k_m2_ks2 = kquant_kernel("Q6_K", 2, KS=2)


# ---------------------------------------------------------------------------------------------
# Host side


def _aligned(t: torch.Tensor, elems: int) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % elems == 0 for s in t.stride()[:-1])


def supports_weight(w: KQuantWeight) -> bool:
    return (
        w.kind in NATIVE
        and on_gpu(w.blocks)
        and w.in_features % QK_K == 0
        and w.blocks.is_contiguous()
        and _aligned(w.blocks, 16)
        and (w.kind != "Q6_K" or (w.scales.is_contiguous() and w.d.is_contiguous()))
    )


def supports(x: torch.Tensor, w: KQuantWeight) -> bool:
    return (
        on_gpu(x)
        and x.dtype == torch.float16
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and x.shape[1] == w.in_features
        and x.stride(-1) == 1
        and _aligned(x, 8)
        and supports_weight(w)
    )


def launch_kquant_gemv(x, w: KQuantWeight, bias, out, tile=None) -> torch.Tensor:
    """One launch for x `supports` accepted, into out [M, N] (a column slice of a wider output
    is fine: the kernel writes out[m, n] one element at a time)."""
    R, KS = tiling(w, x.device, tile)
    has_bias = bias is not None
    b = bias if has_bias else out[0]  # any 1-D array of the dtype; unread
    args = (x, w.words(), b, out, has_bias)
    if w.kind == "Q6_K":
        args = (x, w.words(), w.scales, w.d, b, out, has_bias)
    launch(
        kquant_kernel(w.kind, x.shape[0], R, KS),
        grid_for(w.out_features, R, KS),
        THREADS,
        args,
        current_stream(),
    )
    return out


__all__ = [
    "NATIVE",
    "grid_for",
    "kquant_kernel",
    "launch_kquant_gemv",
    "split_for",
    "supports",
    "supports_weight",
    "tiling",
    "variant_for",
]
