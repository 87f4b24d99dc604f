"""Group-quantized GEMM on Volta tensor cores for batched decode (about 9 to 256 rows):
y[T, N] = x[T, K] @ dequantize(w)^T (+ bias), reference `quant_linear_ref` (quant_linear.py).

numba.cuda throughout; the warp-matrix products are wmma_inline.py's intrinsics (the PTX wmma
m16n16k16 instructions, f16 in, f32 accumulate, emitted inline), so each warp's accumulator
fragments stay in registers for the whole K loop and are stored once, in the epilogue. (Linked C
functions called once a K step would put the accumulators through a per-thread local array on
every step, and the call's ABI would add the caller's live registers to the callee's.)

A thread block of 4, 8 or 16 warps owns a BM x BN output tile, BM = 16, 32, 64 or 128 by row
count (`CONFIGS`, `config_for`), BN = 64 in the defaults (128 or 256 in `CANDIDATES`: 2 or 4
fragments a warp along N), and walks K in steps of BK = 64. Per step:
  1. each thread stores the step's words it holds in registers: x chunks into the A tile
     (16-byte copies, fp16), and its 16-byte chunks of code words (int4: 32 codes of one weight
     row; int8: 16) dequantised with the group's folded (S, O) (quant_common.py) into the B tile
     as fp16 [n][k] (16-byte stores). B is dequantised once per block for all its warps; when
     the block has more threads than code chunks (int4 in 8 or 16 warps, int8 in 16), 2 or 4
     threads share a chunk, each dequantising its part;
  2. barrier; the loads of the NEXT step are issued into registers (so their latency overlaps
     this step's tensor-core work: the weight stream stays in flight; SM70 has no cp.async);
     with `stages=2`, those of the step after it, the next step's already being in registers;
  3. each warp runs its WM x WN fragments over the step's k-slices;
  4. barrier.
The 128-row tile serves 65..256 rows: every dequantised weight tile feeds 128 rows, so at 256
rows each weight is dequantised twice per call, not four times. BK (a TileConfig field) may be
128; a K that is not a multiple of it ends in a half-filled step, whose products stop at K.
Split-K: when the (N / BN) x (T / BM) tiles are too few to fill the GPU (decode-sized T, narrow
N), grid.z = S blocks each take a slice of K and write fp32 partials [S, T, N]; a small kernel
sums them, adds the bias and rounds once. Otherwise the epilogue writes y (+ bias) directly,
through a 16 x 16 f32 staging tile per warp. Rows past T and columns past N are computed from
clamped (re-read) inputs and never written.

Requirements (`supports`): fp16, K a multiple of 64, x contiguous (flat 16-byte chunks).
The CUDA simulator cannot run PTX: under NUMBA_ENABLE_CUDASIM the wmma intrinsics are Python
stand-ins (wmma_inline.py) so the simulator tests run everything around the products, and
`supports_weight` is False, so quant_linear never routes here there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from numba import cuda, float32, uint32
from numba.core.types import float16
from voltserve.kernels.attention.common import ld_u32x4, st_u32x4
from voltserve.kernels.linear.quant_common import bits_f32, fold, ld_w4, st_h8
from voltserve.kernels.linear.quant_pack import GroupQuantWeight
from voltserve.kernels.runtime.compile_cache import cached_factory
from voltserve.kernels.runtime.launch_geometry import on_gpu, recording_active, sm_count
from voltserve.kernels.runtime.numba_common import SIM, current_stream, launch
from voltserve.kernels.runtime.wmma_inline import ZERO_C, load_b_col, mma, store_c
from voltserve.kernels.runtime.wmma_inline import load_a as load_a_frag

PAD = 8  # tile rows padded by 8 elements: rows start in different banks
LDS = 20  # staging tile leading dim (f32), a multiple of 4
MAX_SPLIT = 8
K_ALIGN = 64  # `supports`: K a multiple of this (a step of 128 may end in a half-filled tail)
_ALIGN = None if SIM else 128  # shared tiles: wmma wants 32-byte aligned tile starts


@dataclass(frozen=True)
class TileConfig:
    wgm: int  # warps along M
    wgn: int  # warps along N
    wm: int  # fragments per warp along M (1, 2)
    wn: int  # fragments per warp along N (1, 2, 4)
    bk: int  # K step, a multiple of 16
    # K steps whose loads are in flight in registers while a step's products run: 1 issues step
    # s + 1's loads during step s; 2 also step s + 2's, so a weight load has two steps' products
    # to arrive in instead of one (the loop is latency-bound on that round trip at decode-sized
    # row counts: each step's tile is a few KB).
    stages: int = 1

    @property
    def warps(self) -> int:
        return self.wgm * self.wgn

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def bm(self) -> int:
        return 16 * self.wgm * self.wm

    @property
    def bn(self) -> int:
        return 16 * self.wgn * self.wn

    @property
    def name(self) -> str:
        return f"m{self.bm}n{self.bn}k{self.bk}w{self.wgm}x{self.wgn}f{self.wm}x{self.wn}s{self.stages}"

    def shared_bytes(self) -> int:
        """The three static shared tiles (A, B fp16; the f32 staging tile): at most 48 KiB."""
        ld = self.bk + PAD
        return 2 * (self.bm * ld + self.bn * ld) + 4 * self.warps * 16 * LDS


# Row tiles by row count (`config_for`), with ptxas's registers a thread for sm_70 (the
# registered instances): 16 rows 4 warps (int4 80), 32 rows 8 warps of one fragment each (int8
# 79), 64 rows 8 warps of 2 x 1 fragments (int4 123), beyond 64 rows 128-row tiles of 16 warps
# (123; 512 threads may use 128 at most): each dequantised weight tile feeds 128 rows, so at 256
# rows every weight is dequantised twice, not four times as with 64-row tiles. K steps of 64: a
# step of 128 doubles each thread's chunks in flight and costs 45 to 90 registers (254 for 64
# rows in 4 warps).
CONFIGS = {
    16: TileConfig(1, 4, 1, 1, 64),
    32: TileConfig(2, 4, 1, 1, 64),
    64: TileConfig(2, 4, 2, 1, 64),
    128: TileConfig(4, 4, 2, 1, 64),
}


# Tiles timed beside the defaults (`bench_quant_linear.py --tc-configs`), by the CONFIGS row tile
# whose row counts they serve: wider weight tiles (BN 128, 256: more code bytes per K step and
# each x tile used by more weight rows) and two stages of loads in flight.
CANDIDATES = {
    16: (
        TileConfig(1, 4, 1, 1, 64, 2),
        TileConfig(1, 4, 1, 2, 64, 2),
        TileConfig(1, 4, 1, 4, 64, 2),
        TileConfig(1, 4, 1, 2, 128, 1),
    ),
    32: (
        TileConfig(2, 4, 1, 1, 64, 2),
        TileConfig(2, 4, 1, 2, 64, 1),
        TileConfig(2, 4, 1, 2, 64, 2),
    ),
    64: (
        TileConfig(2, 4, 2, 1, 64, 2),
        TileConfig(2, 4, 2, 2, 64, 1),
        TileConfig(2, 4, 2, 2, 64, 2),
        TileConfig(2, 2, 2, 4, 64, 2),
        TileConfig(2, 4, 2, 1, 128, 1),
    ),
    128: (
        TileConfig(4, 4, 2, 1, 64, 2),
        TileConfig(4, 2, 2, 4, 64, 1),
        TileConfig(4, 2, 2, 4, 64, 2),
    ),
}


def config_for(rows: int) -> TileConfig:
    """The smallest BM that covers `rows` (128 beyond: several row tiles)."""
    for bm in (16, 32, 64):
        if rows <= bm:
            return CONFIGS[bm]
    return CONFIGS[128]


@cached_factory
@functools.cache
def qgemm_kernel(cfg: TileConfig, bits: int):
    """The kernel for one tile shape and code width. Arguments: x flat [T * K] fp16, qweight
    int32 [N, K * bits / 32], scales / offsets [N, groups] fp16, bias [N] fp16, out [T, N] fp16,
    part flat fp32 [S * T * N] (split-K partials; unused when gridDim.z == 1), has_bias,
    group_shift, T, steps per split."""
    WGN, WM, WN = cfg.wgn, cfg.wm, cfg.wn
    BM, BN, BK = cfg.bm, cfg.bn, cfg.bk
    WARPS, THREADS, STAGES = cfg.warps, cfg.threads, cfg.stages
    assert BK % 16 == 0 and 1 <= WM <= 2 and WN in (1, 2, 4) and STAGES in (1, 2)
    assert cfg.shared_bytes() <= 48 * 1024, (cfg, cfg.shared_bytes())
    LDA = LDB = BK + PAD
    A_SIZE = BM * LDA  # shared array sizes must be compile-time constants
    B_SIZE = BN * LDB
    ST_SIZE = WARPS * 16 * LDS
    A_CPR = BK // 8  # 16-byte x chunks (8 fp16) per tile row
    A_CH = BM * A_CPR // THREADS  # x chunks per thread per step
    assert A_CH * THREADS == BM * A_CPR and 1 <= A_CH <= 8
    P = 32 // bits  # codes per int32 word
    CODES = 4 * P  # codes per 16-byte chunk of code words
    B_CPR = BK // CODES  # code chunks per weight row per step
    NB = BN * B_CPR  # code chunks per step
    # Fewer chunks than threads (int4 in 8 or 16 warps): B_SPLIT adjacent threads share one
    # chunk (the same 16-byte load, one transaction), each dequantising a 1 / B_SPLIT part.
    B_SPLIT = max(1, THREADS // NB)
    B_CH = max(1, NB // THREADS)  # code chunks (or parts) per thread
    PART = CODES // B_SPLIT  # codes a thread dequantises per chunk
    assert NB * B_SPLIT == THREADS * B_CH and B_CH <= 4 and B_SPLIT <= 4 // (bits // 4)
    SCALE_MUL = float32(1 << bits)
    z = uint32(0)
    f0 = float32(0.0)
    ZW = (z, z, z, z)
    ZB = (ZW, f0, f0, f0, f0)  # a code chunk in flight: words, (scale, offset) of both halves

    @cuda.jit(device=True, inline="always")
    def load_x(x, T, K, m0, k0, c):
        """x chunk c of the BM x BK tile at (m0, k0); rows past T re-read row T - 1, columns
        past K (the K tail of the last step, which the products skip) re-read the row's last
        chunk."""
        r = c // A_CPR
        k = min(k0 + (c - r * A_CPR) * 8, K - 8)
        m = min(m0 + r, T - 1)
        return ld_u32x4(x, m * K + k)

    @cuda.jit(device=True, inline="always")
    def load_x_all(x, T, K, m0, k0, tid):
        return (
            load_x(x, T, K, m0, k0, tid),
            load_x(x, T, K, m0, k0, tid + THREADS) if A_CH > 1 else ZW,
            load_x(x, T, K, m0, k0, tid + 2 * THREADS) if A_CH > 2 else ZW,
            load_x(x, T, K, m0, k0, tid + 3 * THREADS) if A_CH > 3 else ZW,
            load_x(x, T, K, m0, k0, tid + 4 * THREADS) if A_CH > 4 else ZW,
            load_x(x, T, K, m0, k0, tid + 5 * THREADS) if A_CH > 5 else ZW,
            load_x(x, T, K, m0, k0, tid + 6 * THREADS) if A_CH > 6 else ZW,
            load_x(x, T, K, m0, k0, tid + 7 * THREADS) if A_CH > 7 else ZW,
        )

    @cuda.jit(device=True, inline="always")
    def store_x(a_s, c, u):
        r = c // A_CPR
        st_u32x4(a_s, r * LDA + (c - r * A_CPR) * 8, u[0], u[1], u[2], u[3])

    @cuda.jit(device=True, inline="always")
    def store_x_all(a_s, tid, xa):
        store_x(a_s, tid, xa[0])
        if A_CH > 1:
            store_x(a_s, tid + THREADS, xa[1])
        if A_CH > 2:
            store_x(a_s, tid + 2 * THREADS, xa[2])
        if A_CH > 3:
            store_x(a_s, tid + 3 * THREADS, xa[3])
        if A_CH > 4:
            store_x(a_s, tid + 4 * THREADS, xa[4])
        if A_CH > 5:
            store_x(a_s, tid + 5 * THREADS, xa[5])
        if A_CH > 6:
            store_x(a_s, tid + 6 * THREADS, xa[6])
        if A_CH > 7:
            store_x(a_s, tid + 7 * THREADS, xa[7])

    @cuda.jit(device=True, inline="always")
    def load_b(qw, scales, offsets, n0, k0, K, gshift, c, p):
        """Code chunk c of the BN x BK weight tile at (n0, k0), for part p of it (`B_SPLIT`): 4
        words, and the (scale, offset) of the part's first and second halves (int4 group 16 and
        a whole chunk: two groups; otherwise the same one). Rows past N re-read row N - 1; a
        chunk past K (the K tail) re-reads the last chunk of the row (the products skip the
        tail)."""
        N = qw.shape[0]
        G = scales.shape[1]
        r = c // B_CPR
        row = min(n0 + r, N - 1)
        kk = min(k0 + (c - r * B_CPR) * CODES, K - CODES)
        q = ld_w4(qw, (row, kk // P))
        kp = kk + p * PART
        ga = min(kp >> gshift, G - 1)
        s0 = float32(scales[row, ga])
        o0 = float32(offsets[row, ga])
        s1 = s0
        o1 = o0
        if bits == 4 and B_SPLIT == 1 and gshift < 5:
            gb = min((kk + 16) >> gshift, G - 1)
            s1 = float32(scales[row, gb])
            o1 = float32(offsets[row, gb])
        return (q, s0, o0, s1, o1)

    @cuda.jit(device=True, inline="always")
    def load_b_all(qw, scales, offsets, n0, k0, K, gshift, tid):
        c = tid // B_SPLIT
        p = tid - c * B_SPLIT
        return (
            load_b(qw, scales, offsets, n0, k0, K, gshift, c, p),
            load_b(qw, scales, offsets, n0, k0, K, gshift, c + THREADS, 0) if B_CH > 1 else ZB,
            load_b(qw, scales, offsets, n0, k0, K, gshift, c + 2 * THREADS, 0) if B_CH > 2 else ZB,
            load_b(qw, scales, offsets, n0, k0, K, gshift, c + 3 * THREADS, 0) if B_CH > 3 else ZB,
        )

    @cuda.jit(device=True, inline="always")
    def deq4(u, p0, p1, p2, p3, S, Of):
        """Four codes of word u at bits p0..p3 (constants after inlining) -> 4 fp32 weights."""
        m = (1 << bits) - 1
        pos = 23 - bits
        return (
            bits_f32((((u >> p0) & m) << pos) | 0x3F800000) * S + Of,
            bits_f32((((u >> p1) & m) << pos) | 0x3F800000) * S + Of,
            bits_f32((((u >> p2) & m) << pos) | 0x3F800000) * S + Of,
            bits_f32((((u >> p3) & m) << pos) | 0x3F800000) * S + Of,
        )

    @cuda.jit(device=True, inline="always")
    def store_word8(b_s, dst, u, S, Of):
        """One int4 word (8 codes, pair-interleaved) -> 8 fp16 weights at b_s[dst]."""
        a = deq4(u, 0, 16, 4, 20, S, Of)  # codes 0, 1, 2, 3
        b = deq4(u, 8, 24, 12, 28, S, Of)  # codes 4, 5, 6, 7
        st_h8(b_s, dst, (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]))

    @cuda.jit(device=True, inline="always")
    def store_words4(b_s, dst, u0, u1, S, Of):
        """Two int8 words (4 codes each) -> 8 fp16 weights at b_s[dst]."""
        a = deq4(u0, 0, 16, 8, 24, S, Of)
        b = deq4(u1, 0, 16, 8, 24, S, Of)
        st_h8(b_s, dst, (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]))

    @cuda.jit(device=True, inline="always")
    def store_b(b_s, c, p, st):
        """Part p of code chunk c (`load_b`'s registers) dequantised into the B tile, fp16
        [n][k]."""
        q, s0, o0, s1, o1 = st
        r = c // B_CPR
        dst = r * LDB + (c - r * B_CPR) * CODES + p * PART
        S0, O0 = fold(s0, o0, SCALE_MUL)
        if B_SPLIT == 4:  # int4: word p, 8 codes
            u = q[0] if p == 0 else (q[1] if p == 1 else (q[2] if p == 2 else q[3]))
            store_word8(b_s, dst, u, S0, O0)
        elif B_SPLIT == 2:  # words 2p, 2p + 1: int4 16 codes, int8 8
            u0 = q[2] if p else q[0]
            u1 = q[3] if p else q[1]
            if bits == 4:
                store_word8(b_s, dst, u0, S0, O0)
                store_word8(b_s, dst + 8, u1, S0, O0)
            else:
                store_words4(b_s, dst, u0, u1, S0, O0)
        elif bits == 4:
            S1, O1 = fold(s1, o1, SCALE_MUL)
            store_word8(b_s, dst, q[0], S0, O0)
            store_word8(b_s, dst + 8, q[1], S0, O0)
            store_word8(b_s, dst + 16, q[2], S1, O1)
            store_word8(b_s, dst + 24, q[3], S1, O1)
        else:
            store_words4(b_s, dst, q[0], q[1], S0, O0)
            store_words4(b_s, dst + 8, q[2], q[3], S0, O0)

    @cuda.jit(device=True, inline="always")
    def store_b_all(b_s, tid, bq):
        c = tid // B_SPLIT
        store_b(b_s, c, tid - c * B_SPLIT, bq[0])
        if B_CH > 1:
            store_b(b_s, c + THREADS, 0, bq[1])
        if B_CH > 2:
            store_b(b_s, c + 2 * THREADS, 0, bq[2])
        if B_CH > 3:
            store_b(b_s, c + 3 * THREADS, 0, bq[3])

    @cuda.jit(device=True, inline="always")
    def write_frag(st_s, out, part, bias, has_bias, T, N, m0, n0, warp, wm_, wn_, i, j, c):
        """Fragment (i, j) of the warp: staged as 16 x 16 f32, then its rows < T and columns
        < N into the split-K partials (gridDim.z > 1) or out (+ bias)."""
        st = warp * 16 * LDS
        store_c(st_s, st, c, LDS)
        # Block-wide barriers (every thread runs the epilogue): syncwarp would do, but the
        # simulator has none; the epilogue runs once per tile.
        cuda.syncthreads()
        lane = cuda.threadIdx.x & 31
        r = lane >> 1
        c0 = (lane & 1) * 8
        m = m0 + (wm_ * WM + i) * 16 + r
        nb = n0 + (wn_ * WN + j) * 16 + c0
        if m < T:
            for e in range(8):
                n = nb + e
                if n < N:
                    v = st_s[st + r * LDS + c0 + e]
                    if cuda.gridDim.z > 1:
                        part[(cuda.blockIdx.z * T + m) * N + n] = v
                    else:
                        if has_bias:
                            v += float32(bias[n])
                        out[m, n] = v
        cuda.syncthreads()

    def kernel(x, qw, scales, offsets, bias, out, part, has_bias, gshift, T, steps):
        tid = cuda.threadIdx.x
        warp = tid >> 5
        n0 = cuda.blockIdx.x * BN
        m0 = cuda.blockIdx.y * BM
        N = qw.shape[0]
        K = x.shape[0] // T
        s0 = cuda.blockIdx.z * steps
        s1 = min(s0 + steps, (K + BK - 1) // BK)

        a_s = cuda.shared.array(A_SIZE, float16, alignment=_ALIGN)
        b_s = cuda.shared.array(B_SIZE, float16, alignment=_ALIGN)
        st_s = cuda.shared.array(ST_SIZE, float32, alignment=_ALIGN)
        wm_ = warp // WGN
        wn_ = warp - wm_ * WGN
        a_off = wm_ * 16 * WM * LDA  # this warp's first A row, first B (weight) row
        b_off = wn_ * 16 * WN * LDB
        # The warp's accumulators (fragment (i, j) = c_ij), in registers for the whole K loop.
        c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = ZERO_C

        # Registers of the steps in flight: x chunks, code chunks with their scales/offsets
        # (xa, bq: the next step to store; xb, bb: the one after, with two stages).
        xa = xb = (ZW, ZW, ZW, ZW, ZW, ZW, ZW, ZW)
        bq = bb = (ZB, ZB, ZB, ZB)
        if s0 < s1:
            xa = load_x_all(x, T, K, m0, s0 * BK, tid)
            bq = load_b_all(qw, scales, offsets, n0, s0 * BK, K, gshift, tid)
        if STAGES > 1 and s0 + 1 < s1:
            xb = load_x_all(x, T, K, m0, (s0 + 1) * BK, tid)
            bb = load_b_all(qw, scales, offsets, n0, (s0 + 1) * BK, K, gshift, tid)

        for s in range(s0, s1):
            # 1. this step's registers into the tiles (B dequantised once for all warps)
            store_x_all(a_s, tid, xa)
            store_b_all(b_s, tid, bq)
            cuda.syncthreads()
            # 2. the loads STAGES steps ahead, in flight during this step's products
            if STAGES > 1:
                xa = xb
                bq = bb
                if s + 2 < s1:
                    xb = load_x_all(x, T, K, m0, (s + 2) * BK, tid)
                    bb = load_b_all(qw, scales, offsets, n0, (s + 2) * BK, K, gshift, tid)
            elif s + 1 < s1:
                xa = load_x_all(x, T, K, m0, (s + 1) * BK, tid)
                bq = load_b_all(qw, scales, offsets, n0, (s + 1) * BK, K, gshift, tid)
            # 3. tensor cores: the warp's WM x WN fragments over the step's k-slices, up to K
            # (the K tail: a half-filled last step).
            for kk in range(0, min(BK, K - s * BK), 16):
                fa0 = load_a_frag(a_s, a_off + kk, LDA)
                fa1 = load_a_frag(a_s, a_off + 16 * LDA + kk, LDA) if WM > 1 else fa0
                fb = load_b_col(b_s, b_off + kk, LDB)
                c00 = mma(c00, fa0, fb)
                if WM > 1:
                    c10 = mma(c10, fa1, fb)
                if WN > 1:
                    fb = load_b_col(b_s, b_off + 16 * LDB + kk, LDB)
                    c01 = mma(c01, fa0, fb)
                    if WM > 1:
                        c11 = mma(c11, fa1, fb)
                if WN > 2:
                    fb = load_b_col(b_s, b_off + 32 * LDB + kk, LDB)
                    c02 = mma(c02, fa0, fb)
                    if WM > 1:
                        c12 = mma(c12, fa1, fb)
                    fb = load_b_col(b_s, b_off + 48 * LDB + kk, LDB)
                    c03 = mma(c03, fa0, fb)
                    if WM > 1:
                        c13 = mma(c13, fa1, fb)
            cuda.syncthreads()  # 4. every warp is done with the tiles

        # Epilogue: fragment by fragment through this warp's staging tile.
        write_frag(st_s, out, part, bias, has_bias, T, N, m0, n0, warp, wm_, wn_, 0, 0, c00)
        if WN > 1:
            write_frag(st_s, out, part, bias, has_bias, T, N, m0, n0, warp, wm_, wn_, 0, 1, c01)
        if WN > 2:
            write_frag(st_s, out, part, bias, has_bias, T, N, m0, n0, warp, wm_, wn_, 0, 2, c02)
            write_frag(st_s, out, part, bias, has_bias, T, N, m0, n0, warp, wm_, wn_, 0, 3, c03)
        if WM > 1:
            write_frag(st_s, out, part, bias, has_bias, T, N, m0, n0, warp, wm_, wn_, 1, 0, c10)
        if WM > 1 and WN > 1:
            write_frag(st_s, out, part, bias, has_bias, T, N, m0, n0, warp, wm_, wn_, 1, 1, c11)
        if WM > 1 and WN > 2:
            write_frag(st_s, out, part, bias, has_bias, T, N, m0, n0, warp, wm_, wn_, 1, 2, c12)
            write_frag(st_s, out, part, bias, has_bias, T, N, m0, n0, warp, wm_, wn_, 1, 3, c13)

    # 512 threads a block leave 128 registers a thread (65536 an SM): more fails the launch.
    opts = {"max_registers": 65536 // THREADS} if THREADS > 256 and not SIM else {}
    return cuda.jit(fastmath=False, **opts)(kernel)


@cuda.jit
def qgemm_reduce_kernel(part, bias, out, has_bias, splits):
    """out[m, n] = sum over splits of part[s, m, n] (+ bias[n]), one rounding."""
    T, N = out.shape
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= T * N:
        return
    m = i // N
    n = i - m * N
    v = float32(0.0)
    for s in range(splits):
        v += part[s * T * N + i]
    if has_bias:
        v += float32(bias[n])
    out[m, n] = v


# Representative instances for `voltserve check-kernels` (kernels/registry.py).
qgemm_int4_m16 = qgemm_kernel(CONFIGS[16], 4)
qgemm_int4_m64 = qgemm_kernel(CONFIGS[64], 4)
qgemm_int8_m32 = qgemm_kernel(CONFIGS[32], 8)
qgemm_int4_m128 = qgemm_kernel(CONFIGS[128], 4)
qgemm_int8_m128 = qgemm_kernel(CONFIGS[128], 8)


# ---------------------------------------------------------------------------------------------
# Host side


def supports_weight(w: GroupQuantWeight, dtype: torch.dtype) -> bool:
    return (
        (not SIM or recording_active())  # the simulator has no WMMA; a recording runs nothing
        and on_gpu(w.qweight)
        and dtype == torch.float16
        and w.scales.dtype == torch.float16
        and w.in_features % K_ALIGN == 0
        and w.qweight.is_contiguous()
        and w.qweight.data_ptr() % 16 == 0
        and w.scales.is_contiguous()
        and w.offsets.is_contiguous()
    )


def split_for(tiles: int, k_steps: int, sms: int, warps: int = 4) -> int:
    """Split-K factor: enough blocks for about 8 warps per SM (two blocks of 4 warps, one of 8 or
    16), each keeping at least 4 K steps; none when the tiles alone fill 7/8 of that."""
    target = sms * max(1, 8 // warps)
    if 8 * tiles >= 7 * target:
        return 1
    want = -(-target // tiles)
    return max(1, min(want, MAX_SPLIT, k_steps // 4))


def quant_gemm_tc_cuda(
    x: torch.Tensor,
    w: GroupQuantWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split: int | None = None,
    cfg: TileConfig | None = None,
) -> torch.Tensor:
    """quant_linear_ref's meaning with tensor cores, x [T, K] fp16 (already permuted by the
    caller). split: the split-K factor (None: `split_for`); cfg: the tile config (None:
    `config_for(T)`; others for tests and tuning). No host sync: graph-capturable (the
    split-K partials are allocated from torch's caching allocator on the current stream)."""
    if not supports_weight(w, x.dtype):
        raise ValueError("quant_gemm_tc_cuda: weight not supported (see supports_weight)")
    T, K = x.shape
    N = w.out_features
    if out is None:
        out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = x.contiguous()
    if x.data_ptr() % 16:  # a view at an odd offset: the 16-byte chunk loads need alignment
        x = x.clone()
    cfg = cfg or config_for(T)
    tiles_n, tiles_m = -(-N // cfg.bn), -(-T // cfg.bm)
    k_steps = -(-K // cfg.bk)
    S = (
        split
        if split is not None
        else split_for(tiles_n * tiles_m, k_steps, sm_count(x.device), cfg.warps)
    )
    steps = -(-k_steps // S)
    S = -(-k_steps // steps)  # no empty slices
    has_bias = bias is not None
    b = bias if has_bias else w.scales.view(-1)  # unread without a bias
    part = torch.empty(S * T * N if S > 1 else 1, dtype=torch.float32, device=x.device)
    stream = current_stream()
    launch(
        qgemm_kernel(cfg, w.bits),
        (tiles_n, tiles_m, S),
        cfg.threads,
        (
            x.view(-1),
            w.qweight,
            w.scales,
            w.offsets,
            b,
            out,
            part,
            has_bias,
            w.group_shift,
            T,
            steps,
        ),
        stream,
    )
    if S > 1:
        launch(
            qgemm_reduce_kernel,
            -(-T * N // 256),
            256,
            (part, b, out, has_bias, S),
            stream,
        )
    return out


__all__ = ["quant_gemm_tc_cuda", "supports_weight", "qgemm_kernel", "config_for", "split_for"]
