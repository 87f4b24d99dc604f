"""Group-quantized GEMM on Volta tensor cores for batched decode (about 9 to 256 rows):
y[T, N] = x[T, K] @ dequantize(w)^T (+ bias), reference `quant_linear_ref` (quant_linear.py).

numba.cuda orchestrates; the warp-matrix products are wmma_ptx.cu's `vs_qgemm_step_*` (inline
PTX wmma m16n16k16, f16 in, f32 accumulate), linked and handed shared/local array pointers via
cffi's `from_buffer`, the route prefill_attention_tc.py uses.

A thread block (4 warps) owns a BM x BN = (16|32|64) x 64 output tile and walks K in steps of
BK = 64. Per step:
  1. each thread stores the step's words it holds in registers: x chunks into the A tile
     (16-byte copies, fp16), and one 16-byte chunk of code words (int4: 32 codes of one weight
     row; int8: two chunks of 16) dequantised with the group's folded (S, O) (quant_common.py)
     into the B tile as fp16 [n][k] (16-byte stores);
  2. barrier; the loads of the NEXT step are issued into registers (so their latency overlaps
     this step's tensor-core work: the weight stream stays in flight);
  3. each warp runs its WM x WN fragments over the BK / 16 k-slices (one C++ call; the
     accumulators live in a per-thread array between calls, as in prefill_attention_tc);
  4. barrier.
Split-K: when the (N / BN) x (T / BM) tiles are too few to fill the GPU (decode-sized T, narrow
N), grid.z = S blocks each take a slice of K and write fp32 partials [S, T, N]; a small kernel
sums them, adds the bias and rounds once. Otherwise the epilogue writes y (+ bias) directly,
through a 16 x 16 f32 staging tile per warp. Rows past T and columns past N are computed from
clamped (re-read) inputs and never written.

Requirements (`supports`): fp16, K a multiple of 64, x contiguous (flat 16-byte chunks).
The CUDA simulator cannot run linked C++: under NUMBA_ENABLE_CUDASIM the two wmma functions
are replaced by Python stand-ins (see below) so the simulator tests run the numba side, and
`supports_weight` is False, so quant_linear never routes here there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from numba import cuda, float32, int32, uint32
from numba.core.types import float16
from voltserve.kernels.numba_common import SIM, current_stream, dev, launch
from voltserve.kernels.prefill_attention_tc import WMMA_CU
from voltserve.kernels.quant_common import bits_f32, fold, ld_w4, st_h8
from voltserve.kernels.quant_pack import GroupQuantWeight

CUDA_SOURCES: tuple[str, ...] = (WMMA_CU,)
BK = 64  # must equal VS_QGEMM_BK in wmma_ptx.cu
BN = 64
WARPS = 4
THREADS = 32 * WARPS
LDA = BK + 8  # padded leading dims (elements): rows start in different banks
LDB = BK + 8
LDS = 20  # staging tile leading dim (f32), a multiple of 4
MAX_SPLIT = 8
_ALIGN = None if SIM else 128  # shared tiles: wmma wants 32-byte aligned tile starts


@dataclass(frozen=True)
class TileConfig:
    wgm: int  # warps along M
    wgn: int  # warps along N (wgm * wgn == WARPS)
    wm: int  # fragments per warp along M
    wn: int  # fragments per warp along N

    @property
    def bm(self) -> int:
        return 16 * self.wgm * self.wm

    @property
    def bn(self) -> int:
        return 16 * self.wgn * self.wn


CONFIGS = {16: TileConfig(1, 4, 1, 1), 32: TileConfig(1, 4, 2, 1), 64: TileConfig(2, 2, 2, 2)}


def config_for(rows: int) -> TileConfig:
    """The smallest BM that covers `rows` (64 beyond: several row tiles)."""
    for bm in (16, 32):
        if rows <= bm:
            return CONFIGS[bm]
    return CONFIGS[64]


if not SIM:
    import cffi
    from numba import types
    from voltserve.kernels.attention_common import ld_u32x4, st_u32x4

    ffi = cffi.FFI()
    _P16 = types.CPointer(types.float16)
    _P32 = types.CPointer(types.float32)
    _I32 = types.int32

    def _declare(name: str, *args):
        return cuda.declare_device(name, types.int32(*args), link=[WMMA_CU], abi="c")

    # (acc, a, a_off, lda, b, b_off, ldb)
    _STEP = {
        (wm, wn): _declare(f"vs_qgemm_step_w{wm}{wn}", _P32, _P16, _I32, _I32, _P16, _I32, _I32)
        for wm, wn in ((2, 2), (2, 1), (1, 1))
    }
    # (acc, f, stage, st_off, ld)
    qgemm_store_frag = _declare("vs_qgemm_store_frag", _P32, _I32, _P32, _I32, _I32)
else:
    # The simulator cannot run the linked wmma functions. These stand-ins compute the same
    # products with one fixed (made-up) fragment layout, lane l holding row l >> 1 and columns
    # (l & 1) * 8 .. + 8 of each 16 x 16 tile; the real layout is opaque to the kernel, which
    # only moves fragments between the two functions. So the simulator tests check everything
    # the numba side does (tile fills, dequantisation, pipelining, split-K, epilogue).
    import numpy as np
    from voltserve.kernels.attention_common import ld_u32x4, st_u32x4

    class _NoFfi:
        @staticmethod
        def from_buffer(a):
            return a

    ffi = _NoFfi()

    def _sim_step(wm: int, wn: int):
        def step(acc, a, a_off, lda, b, b_off, ldb):
            lane = cuda.threadIdx.x & 31
            r, c0 = lane >> 1, (lane & 1) * 8
            for i in range(wm):
                ra = a_off + (i * 16 + r) * lda
                av = np.asarray(a[ra : ra + BK], dtype=np.float32)
                for j in range(wn):
                    for e in range(8):
                        rb = b_off + (j * 16 + c0 + e) * ldb
                        bv = np.asarray(b[rb : rb + BK], dtype=np.float32)
                        acc[(i * wn + j) * 8 + e] += np.float32(np.dot(av, bv))
            return 0

        return step

    _STEP = {(wm, wn): _sim_step(wm, wn) for wm, wn in ((2, 2), (2, 1), (1, 1))}

    def qgemm_store_frag(acc, f, stage, st_off, ld):
        lane = cuda.threadIdx.x & 31
        r, c0 = lane >> 1, (lane & 1) * 8
        for e in range(8):
            stage[st_off + r * ld + c0 + e] = acc[f * 8 + e]
        return 0


@functools.cache
def qgemm_kernel(cfg: TileConfig, bits: int):
    """The kernel for one tile shape and code width. Arguments: x flat [T * K] fp16, qweight
    int32 [N, K * bits / 32], scales / offsets [N, groups] fp16, bias [N] fp16, out [T, N] fp16,
    part flat fp32 [S * T * N] (split-K partials; unused when gridDim.z == 1), has_bias,
    group_shift, T, steps per split."""
    WGN, WM, WN = cfg.wgn, cfg.wm, cfg.wn
    BM = cfg.bm
    assert cfg.bn == BN and cfg.wgm * WGN == WARPS
    NFRAG = WM * WN
    A_SIZE = BM * LDA  # shared array sizes must be compile-time constants
    B_SIZE = BN * LDB
    ST_SIZE = WARPS * 16 * LDS
    NACC = NFRAG * 8
    A_CH = BM * (BK // 8) // THREADS  # 16-byte x chunks per thread per step
    assert A_CH * THREADS == BM * BK // 8 and 1 <= A_CH <= 4
    P = 32 // bits
    SCALE_MUL = float32(1 << bits)
    step_fn = _STEP[(WM, WN)]
    store_fn = qgemm_store_frag
    z = uint32(0)
    ZW = (z, z, z, z)

    @cuda.jit(device=True, inline="always")
    def load_a(x, T, K, m0, k0, i):
        """x chunk i (of the BM x BK tile at (m0, k0)); rows past T re-read row T - 1."""
        r = i >> 3
        m = min(m0 + r, T - 1)
        return ld_u32x4(x, m * K + k0 + (i & 7) * 8)

    @cuda.jit(device=True, inline="always")
    def store_a(a_s, i, u):
        st_u32x4(a_s, (i >> 3) * LDA + (i & 7) * 8, u[0], u[1], u[2], u[3])

    @cuda.jit(device=True, inline="always")
    def deq8(u, p0, p1, p2, p3, S, Of):
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
        a = deq8(u, 0, 16, 4, 20, S, Of)  # codes 0, 1, 2, 3
        b = deq8(u, 8, 24, 12, 28, S, Of)  # codes 4, 5, 6, 7
        st_h8(b_s, dst, (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]))

    @cuda.jit(device=True, inline="always")
    def store_words4(b_s, dst, u0, u1, S, Of):
        """Two int8 words (4 codes each) -> 8 fp16 weights at b_s[dst]."""
        a = deq8(u0, 0, 16, 8, 24, S, Of)
        b = deq8(u1, 0, 16, 8, 24, S, Of)
        st_h8(b_s, dst, (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]))

    def kernel(x, qw, scales, offsets, bias, out, part, has_bias, gshift, T, steps):
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        n0 = cuda.blockIdx.x * BN
        m0 = cuda.blockIdx.y * BM
        N = qw.shape[0]
        G = scales.shape[1]
        K = x.shape[0] // T
        s0 = cuda.blockIdx.z * steps
        s1 = min(s0 + steps, K // BK)

        a_s = cuda.shared.array(A_SIZE, float16, alignment=_ALIGN)
        b_s = cuda.shared.array(B_SIZE, float16, alignment=_ALIGN)
        st_s = cuda.shared.array(ST_SIZE, float32, alignment=_ALIGN)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)
        a_ptr = ffi.from_buffer(a_s)
        b_ptr = ffi.from_buffer(b_s)
        st_ptr = ffi.from_buffer(st_s)
        acc_ptr = ffi.from_buffer(acc)

        # This thread's B work: int4: row tid >> 1, codes (tid & 1) * 32 .. + 32 of the step
        # (one 16-byte chunk); int8: rows tid >> 2 and 32 + (tid >> 2), codes (tid & 3) * 16.
        if bits == 4:
            bn_a = tid >> 1
            bk_a = (tid & 1) * 32
        else:
            bn_a = tid >> 2
            bk_a = (tid & 3) * 16
        bn_b = bn_a + 32
        rw_a = min(n0 + bn_a, N - 1)
        rw_b = min(n0 + bn_b, N - 1)

        # Registers of the step in flight: x chunks, code words, scales/offsets.
        xa0 = xa1 = xa2 = xa3 = ZW
        qa = qb = ZW
        sa = oa = sb = ob = sc = oc = float32(0.0)
        if s0 < s1:
            k0 = s0 * BK
            xa0 = load_a(x, T, K, m0, k0, tid)
            if A_CH > 1:
                xa1 = load_a(x, T, K, m0, k0, tid + THREADS)
            if A_CH > 2:
                xa2 = load_a(x, T, K, m0, k0, tid + 2 * THREADS)
            if A_CH > 3:
                xa3 = load_a(x, T, K, m0, k0, tid + 3 * THREADS)
            kk = k0 + bk_a
            qa = ld_w4(qw, (rw_a, kk // P))
            ga = min(kk >> gshift, G - 1)
            sa = float32(scales[rw_a, ga])
            oa = float32(offsets[rw_a, ga])
            if bits == 4:  # the chunk's second half may be the next group (group 16)
                gb = min((kk + 16) >> gshift, G - 1)
                sb = float32(scales[rw_a, gb])
                ob = float32(offsets[rw_a, gb])
            else:
                qb = ld_w4(qw, (rw_b, kk // P))
                sc = float32(scales[rw_b, ga])
                oc = float32(offsets[rw_b, ga])

        for s in range(s0, s1):
            # 1. this step's registers into the tiles
            store_a(a_s, tid, xa0)
            if A_CH > 1:
                store_a(a_s, tid + THREADS, xa1)
            if A_CH > 2:
                store_a(a_s, tid + 2 * THREADS, xa2)
            if A_CH > 3:
                store_a(a_s, tid + 3 * THREADS, xa3)
            SA, OA = fold(sa, oa, SCALE_MUL)
            if bits == 4:
                SB, OB = fold(sb, ob, SCALE_MUL)
                dst = bn_a * LDB + bk_a
                store_word8(b_s, dst, qa[0], SA, OA)
                store_word8(b_s, dst + 8, qa[1], SA, OA)
                store_word8(b_s, dst + 16, qa[2], SB, OB)
                store_word8(b_s, dst + 24, qa[3], SB, OB)
            else:
                SC, OC = fold(sc, oc, SCALE_MUL)
                dst = bn_a * LDB + bk_a
                store_words4(b_s, dst, qa[0], qa[1], SA, OA)
                store_words4(b_s, dst + 8, qa[2], qa[3], SA, OA)
                dst = bn_b * LDB + bk_a
                store_words4(b_s, dst, qb[0], qb[1], SC, OC)
                store_words4(b_s, dst + 8, qb[2], qb[3], SC, OC)
            cuda.syncthreads()
            # 2. the next step's loads, in flight during this step's products
            if s + 1 < s1:
                k0 = (s + 1) * BK
                xa0 = load_a(x, T, K, m0, k0, tid)
                if A_CH > 1:
                    xa1 = load_a(x, T, K, m0, k0, tid + THREADS)
                if A_CH > 2:
                    xa2 = load_a(x, T, K, m0, k0, tid + 2 * THREADS)
                if A_CH > 3:
                    xa3 = load_a(x, T, K, m0, k0, tid + 3 * THREADS)
                kk = k0 + bk_a
                qa = ld_w4(qw, (rw_a, kk // P))
                ga = min(kk >> gshift, G - 1)
                sa = float32(scales[rw_a, ga])
                oa = float32(offsets[rw_a, ga])
                if bits == 4:
                    gb = min((kk + 16) >> gshift, G - 1)
                    sb = float32(scales[rw_a, gb])
                    ob = float32(offsets[rw_a, gb])
                else:
                    qb = ld_w4(qw, (rw_b, kk // P))
                    sc = float32(scales[rw_b, ga])
                    oc = float32(offsets[rw_b, ga])
            # 3. tensor cores
            wm_ = warp // WGN
            wn_ = warp - wm_ * WGN
            step_fn(
                acc_ptr,
                a_ptr,
                int32(wm_ * 16 * WM * LDA),
                LDA,
                b_ptr,
                int32(wn_ * 16 * WN * LDB),
                LDB,
            )
            cuda.syncthreads()  # 4. every warp is done with the tiles

        # Epilogue: fragment by fragment through this warp's staging tile.
        wm_ = warp // WGN
        wn_ = warp - wm_ * WGN
        r = lane >> 1
        c0 = (lane & 1) * 8
        split = cuda.gridDim.z > 1
        for f in range(NFRAG):
            i = f // WN
            j = f - i * WN
            store_fn(acc_ptr, int32(f), st_ptr, int32(warp * 16 * LDS), LDS)
            # Block-wide barriers (every thread runs this loop): syncwarp would do, but the
            # simulator has none; the epilogue runs once per tile.
            cuda.syncthreads()
            m = m0 + (wm_ * WM + i) * 16 + r
            nb = n0 + (wn_ * WN + j) * 16 + c0
            if m < T:
                for e in range(8):
                    n = nb + e
                    if n < N:
                        v = st_s[warp * 16 * LDS + r * LDS + c0 + e]
                        if split:
                            part[(cuda.blockIdx.z * T + m) * N + n] = v
                        else:
                            if has_bias:
                                v += float32(bias[n])
                            out[m, n] = v
            cuda.syncthreads()

    return cuda.jit(fastmath=False)(kernel)


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


# ---------------------------------------------------------------------------------------------
# Host side


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def supports_weight(w: GroupQuantWeight, dtype: torch.dtype) -> bool:
    return (
        not SIM
        and w.qweight.is_cuda
        and dtype == torch.float16
        and w.scales.dtype == torch.float16
        and w.in_features % BK == 0
        and w.qweight.is_contiguous()
        and w.qweight.data_ptr() % 16 == 0
        and w.scales.is_contiguous()
        and w.offsets.is_contiguous()
    )


def split_for(tiles: int, k_steps: int, sms: int) -> int:
    """Split-K factor: enough blocks for two per SM, each keeping at least 4 K steps."""
    if tiles >= 2 * sms:
        return 1
    want = -(-2 * sms // tiles)
    return max(1, min(want, MAX_SPLIT, k_steps // 4))


def quant_gemm_tc_cuda(
    x: torch.Tensor,
    w: GroupQuantWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """quant_linear_ref's meaning with tensor cores, x [T, K] fp16 (already permuted by the
    caller). split: the split-K factor (None: `split_for`). No host sync: graph-capturable (the
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
    cfg = config_for(T)
    tiles_n, tiles_m = -(-N // BN), -(-T // cfg.bm)
    k_steps = K // BK
    S = (
        split
        if split is not None
        else split_for(tiles_n * tiles_m, k_steps, _sm_count(x.device.index or 0))
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
        THREADS,
        (
            dev(x.view(-1)),
            dev(w.qweight),
            dev(w.scales),
            dev(w.offsets),
            dev(b),
            dev(out),
            dev(part),
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
            (dev(part), dev(b), dev(out), has_bias, S),
            stream,
        )
    return out


__all__ = ["quant_gemm_tc_cuda", "supports_weight", "qgemm_kernel", "config_for", "split_for"]
