"""Prefill: the gated delta rule over a packed varlen batch (cu_seqlens), in chunks of 64 tokens,
each sequence starting from its slot's state (or zeros) and writing its final state back.

Per chunk of L <= 64 tokens of one value head, with c the running sum of g inside the chunk
(log decay since the chunk's start), kn / qn the L2-normalised k / q (q also times 1/sqrt(Dk)):

    A[t, s] = beta_t kn_t . kn_s exp(c_t - c_s)   (s < t)      M = (I + A)^-1  (unit lower)
    W = M (beta kn exp(c))    U = M (beta v)                    (the WY / UT form of the L
                                                                 delta-rule updates)
    V' = U - W S              O = (qn exp(c)) S + ((qn kn^T) o exp(c_t - c_s))_(s<=t) V'
    S <- exp(c_L) S + (kn exp(c_L - c))^T V'

Two kernels:

1. gdn_chunk_prep_kernel, one block per (chunk, value head), 256 threads: everything that does
   not depend on the state. g and beta from a and b (gating.gates); k k^T and q k^T over 32-wide
   slices of Dk staged in shared memory (each thread 16 of the 64 x 64 pairs, the lower
   triangle only), with the row norms taken in the same pass and applied after; M by forward
   substitution (one thread per column, no barrier per row); then W, U, the scaled queries
   Q' = qn exp(c), the decayed keys K' = kn exp(c_L - c), the masked intra-chunk scores and c
   written to fp32 scratch ([T, Hv, Dk], [T, Hv, Dv], [T, Hv, 64], [T, Hv]). A block finds its
   chunk by walking cu_seqlens, so the grid (T / 64 + sequences, Hv) needs no host sync; blocks
   past the last chunk return.
2. gdn_chunk_scan_kernel, one block per (32 state columns, value head, sequence), 256 threads:
   the state tile [Dk, 32] fp32 in shared memory for the whole sequence, chunk after chunk:
   V' (a thread owns 8 (token, column) items; a warp shares the token, lane = column), O
   (written out), then the state update (16 (row, column) items a thread).

   Its inner loops are issue-bound unless their addressing is cheap, so a slice of K that lies
   inside one operand (every slice at Dk = 128) runs a path with no per-step guard: the
   operand tile is staged by straight-line loads (vec_io.ld1: no wraparound code, each address
   the last plus a stride) when the chunk is whole, and the K steps read shared memory through
   unsigned indices (numba_common.uidx), which the compiler turns into immediate offsets.
   SASS of the cc 7.0 PTX for sm_90: the V' / O loop takes 57 instructions for 32 FMAs (it took
   153 for 16 with plain numba indexing), the state update 66 for 32 (87 for 16), a 32-wide
   stage fill about 30 (about 250); a slice or chunk that is partial keeps the guarded loops.
   The prep kernel's loops (the pair products, the forward substitution, W and U) run over
   unsigned shared indices the same way: 2.8 instructions an FMA in the pair products (12.5
   with plain indexing), 3.6 in the other two (about 20); capped at 128 registers it spills
   100 bytes for sm_70 (28 before).

CUDA cores, not WMMA, and why: Volta's tensor cores take fp16 operands only. The products that
carry the state (W S, Q' S, K'^T V') would need S rounded to fp16 every chunk, which is what
keeping the state in fp32 exists to avoid; M's entries grow with the chunk (they are products of
up to 63 factors) and lose their small terms in fp16. The products that would take fp16 exactly
(k k^T, q k^T: the inputs are fp16) are about a quarter of the FLOPs of a chunk. So the fp32
version is what is here; WMMA for those two products is the next step (see the benchmark for
the CUDA-core roofline it is measured against).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import cuda
from voltserve.kernels.linear_attention.gating import gates, gates_ref
from voltserve.kernels.linear_attention.recurrent import L2_EPS, MAX_DK, check_shapes, l2norm_ref
from voltserve.kernels.runtime.compile_cache import cached
from voltserve.kernels.runtime.launch_geometry import on_gpu
from voltserve.kernels.runtime.numba_common import SIM, current_stream, float32, launch, uidx
from voltserve.kernels.runtime.vec_io import ld1

CHUNK = 64
THREADS = 256
SLICE = 32  # Dk / Dv columns staged at a time in the prep kernel
PAIRS = CHUNK * CHUNK // THREADS  # (t, s) pairs a thread accumulates
ITEMS = CHUNK * SLICE // THREADS  # (t, column) items a thread computes per slice
COLS = 32  # state columns a scan block owns
# Shared row strides padded by one word: threads of a warp reading down a column hit distinct
# banks (shared array shapes must be plain constants, hence the names).
A_LD = CHUNK + 1
SLICE_LD = SLICE + 1
STAGE = CHUNK * SLICE_LD  # the scan kernel's operand staging buffer (floats)
KT = STAGE // MAX_DK  # tokens of K' staged at a time in the state update
# The prep kernel is capped at 128 registers a thread (ptxas takes 163 for sm_70 when free, 28
# bytes of spill at the cap): two 256-thread blocks per SM instead of one. The scan kernel is left
# free (255, one block per SM): at 128 it spills 712 bytes inside its loops. The simulator takes
# no such option.
PREP_JIT = {} if SIM else {"max_registers": 128}
STATE_ITEMS = MAX_DK * COLS // THREADS
OUT_ITEMS = CHUNK * COLS // THREADS


def gated_delta_rule_prefill_ref(
    q: torch.Tensor,  # [T, Hk, Dk] packed
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    a: torch.Tensor,  # [T, Hv]
    b: torch.Tensor,  # [T, Hv]
    A_log: torch.Tensor,  # [Hv] fp32
    dt_bias: torch.Tensor,  # [Hv] fp32
    state_pool: torch.Tensor,  # [num_slots, Hv, Dk, Dv] fp32, updated in place
    cu_seqlens: torch.Tensor,  # [N + 1] int64
    slots: torch.Tensor,  # [N] int64, -1 = padding
    has_initial: torch.Tensor,  # [N] bool: start from the slot's state (else zeros)
) -> torch.Tensor:
    """Returns o [T, Hv, Dv] in v's dtype (zeros for padding sequences); writes each sequence's
    final state into state_pool[slots[i]]."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    rep = Hv // Hk
    out = torch.zeros_like(v)
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        sl = slice(cu[i], cu[i + 1])
        qn = l2norm_ref(q[sl].float()).repeat_interleave(rep, 1).transpose(0, 1) * Dk**-0.5
        kn = l2norm_ref(k[sl].float()).repeat_interleave(rep, 1).transpose(0, 1)
        vv = v[sl].float().transpose(0, 1)  # [Hv, n, Dv]
        g, beta = (x.t() for x in gates_ref(a[sl], b[sl], A_log, dt_bias))  # [Hv, n]
        S = state_pool[slot].clone() if bool(has_initial[i]) else q.new_zeros(Hv, Dk, Dv).float()
        o = torch.empty_like(vv)
        for c0 in range(0, cu[i + 1] - cu[i], CHUNK):
            c = slice(c0, c0 + CHUNK)
            qc, kc, vc, bc = qn[:, c], kn[:, c], vv[:, c], beta[:, c]
            cs = g[:, c].cumsum(-1)
            L = cs.shape[1]
            diff = cs[:, :, None] - cs[:, None, :]
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            decay = torch.where(causal, diff, float("-inf")).exp()
            A = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
            eye = torch.eye(L, device=q.device).expand(Hv, L, L)
            M = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
            W = M @ (kc * (bc * cs.exp())[..., None])
            U = M @ (vc * bc[..., None])
            vn = U - W @ S
            o[:, c] = (qc * cs.exp()[..., None]) @ S + ((qc @ kc.transpose(1, 2)) * decay) @ vn
            last = cs[:, -1:]
            S = S * last.exp()[..., None] + (kc * (last - cs).exp()[..., None]).transpose(1, 2) @ vn
        state_pool[slot] = S
        out[sl] = o.transpose(0, 1).to(v.dtype)
    return out


@cached
@cuda.jit(**PREP_JIT)
def gdn_chunk_prep_kernel(
    q, k, v, a, b, a_log, dt_bias, cu_seqlens, slots, w_out, u_out, qs_out, kd_out, qk_out,
    cs_out, scale,
):  # fmt: skip
    blk, h = cuda.blockIdx.x, cuda.blockIdx.y
    tid = cuda.threadIdx.x
    seq = -1
    ci = blk
    for s in range(slots.shape[0]):
        nc = (cu_seqlens[s + 1] - cu_seqlens[s] + CHUNK - 1) // CHUNK
        if seq < 0:
            if ci < nc:
                seq = s
            else:
                ci -= nc
    if seq < 0:
        return
    if slots[seq] < 0:
        return
    t0 = cu_seqlens[seq] + ci * CHUNK
    L = min(CHUNK, cu_seqlens[seq + 1] - t0)
    Dk, Dv = q.shape[2], v.shape[2]
    hk = h // (v.shape[1] // q.shape[1])

    cs = cuda.shared.array(CHUNK, float32)
    bt = cuda.shared.array(CHUNK, float32)
    iq = cuda.shared.array(CHUNK, float32)
    ik = cuda.shared.array(CHUNK, float32)
    A = cuda.shared.array((CHUNK, A_LD), float32)
    ksl = cuda.shared.array((CHUNK, SLICE_LD), float32)
    qsl = cuda.shared.array((CHUNK, SLICE_LD), float32)

    if tid < CHUNK:
        gv = float32(0.0)
        bv = float32(0.0)
        if tid < L:
            gv, bv = gates(a[t0 + tid, h], b[t0 + tid, h], a_log[h], dt_bias[h], b)
        cs[tid] = gv
        bt[tid] = bv
    cuda.syncthreads()
    if tid == 0:
        for t in range(1, CHUNK):  # padding rows add g = 0: c stays at c_L
            cs[uidx(t)] += cs[uidx(t - 1)]
    ut = uidx(tid)  # unsigned shared indices in the loops below (numba_common.uidx)

    # Pass 1: raw k k^T, q k^T and the squared row norms, over Dk slices.
    acc_a = cuda.local.array(PAIRS, float32)
    acc_q = cuda.local.array(PAIRS, float32)
    for m in range(PAIRS):
        acc_a[m] = 0.0
        acc_q[m] = 0.0
    sq = float32(0.0)
    sk = float32(0.0)
    for d0 in range(0, Dk, SLICE):
        for m in range(ITEMS):
            p = tid + m * THREADS
            t, dd = p // SLICE, p % SLICE
            kv = float32(0.0)
            qv = float32(0.0)
            if t < L and d0 + dd < Dk:
                kv = float32(k[t0 + t, hk, d0 + dd])
                qv = float32(q[t0 + t, hk, d0 + dd])
            ksl[t, dd] = kv
            qsl[t, dd] = qv
        cuda.syncthreads()
        usw = uidx(min(SLICE, Dk - d0))
        if tid < CHUNK:
            dd = uidx(0)
            while dd < usw:
                sk += ksl[ut, dd] * ksl[ut, dd]
                sq += qsl[ut, dd] * qsl[ut, dd]
                dd += uidx(1)
        for m in range(PAIRS):
            p = tid + m * THREADS
            t, s = p // CHUNK, p % CHUNK
            if s <= t and t < L:
                xa = float32(0.0)
                xq = float32(0.0)
                row, col = uidx(t), uidx(s)
                dd = uidx(0)
                while dd < usw:
                    kc = ksl[col, dd]
                    xa += ksl[row, dd] * kc
                    xq += qsl[row, dd] * kc
                    dd += uidx(1)
                acc_a[m] += xa
                acc_q[m] += xq
        cuda.syncthreads()
    if tid < CHUNK:
        iq[tid] = float32(1.0) / math.sqrt(sq + float32(L2_EPS))
        ik[tid] = float32(1.0) / math.sqrt(sk + float32(L2_EPS))
    cuda.syncthreads()
    for m in range(PAIRS):
        p = tid + m * THREADS
        t, s = p // CHUNK, p % CHUNK
        dec = float32(0.0)
        if s <= t:
            dec = float32(math.exp(cs[t] - cs[s]))
        av = float32(0.0)
        if s < t and t < L:
            av = bt[t] * acc_a[m] * ik[t] * ik[s] * dec
        A[t, s] = av
        if t < L:
            qk_out[t0 + t, h, s] = acc_q[m] * iq[t] * ik[s] * scale * dec
    cuda.syncthreads()

    # M = (I + A)^-1: thread r computes column r down the rows, M[t, r] = -A[t, r] -
    # sum_{r < s < t} A[t, s] M[s, r], into the free upper triangle (M[t, r] at A[r, t]), so no
    # thread overwrites an entry of A another still reads and no barrier is needed per row.
    if tid < L:
        for t in range(tid + 1, L):
            row = uidx(t)
            val = -A[row, ut]
            sc = ut + uidx(1)
            while sc < row:
                val -= A[row, sc] * A[ut, sc]
                sc += uidx(1)
            A[ut, row] = val
    cuda.syncthreads()

    # Pass 2: W = M (beta kn exp(c)), with Q' and K' written on the way; pass 3: U = M (beta v).
    last = cs[CHUNK - 1]
    nk = (Dk + SLICE - 1) // SLICE
    for si in range(nk + (Dv + SLICE - 1) // SLICE):
        is_k = si < nk
        base = si * SLICE if is_k else (si - nk) * SLICE
        width = Dk if is_k else Dv
        for m in range(ITEMS):
            p = tid + m * THREADS
            t, dd = p // SLICE, p % SLICE
            d = base + dd
            x = float32(0.0)
            if t < L and d < width:
                if is_k:
                    kn = float32(k[t0 + t, hk, d]) * ik[t]
                    x = kn * bt[t] * float32(math.exp(cs[t]))
                    qs_out[t0 + t, h, d] = (
                        float32(q[t0 + t, hk, d]) * iq[t] * scale * float32(math.exp(cs[t]))
                    )
                    kd_out[t0 + t, h, d] = kn * float32(math.exp(last - cs[t]))
                else:
                    x = float32(v[t0 + t, h, d]) * bt[t]
            ksl[t, dd] = x
        cuda.syncthreads()
        for m in range(ITEMS):
            p = tid + m * THREADS
            t, dd = p // SLICE, p % SLICE
            d = base + dd
            if t < L and d < width:
                row, col = uidx(t), uidx(dd)
                val = ksl[row, col]
                sr = uidx(0)
                while sr < row:
                    val += A[sr, row] * ksl[sr, col]
                    sr += uidx(1)
                if is_k:
                    w_out[t0 + t, h, d] = val
                else:
                    u_out[t0 + t, h, d] = val
        cuda.syncthreads()
    if tid < L:
        cs_out[t0 + tid, h] = cs[tid]


@cuda.jit(device=True, inline="always")
def _mac_slice(acc, stage, B, brow, utc, tr):
    """acc[2 r + c] += the staged A rows tr * 4 + r times B[brow + kk, tc + 16 c] over the 32
    K steps kk of a slice (unsigned shared indices; inlined per B, so both stay shared-space
    accesses)."""
    a0 = uidx(tr * 4 * SLICE_LD)
    kk = uidx(0)
    while kk < uidx(SLICE):
        b0 = B[brow + kk, utc]
        b1 = B[brow + kk, utc + uidx(16)]
        for r in range(4):
            a_ = stage[a0 + uidx(r * SLICE_LD) + kk]
            acc[2 * r] += a_ * b0
            acc[2 * r + 1] += a_ * b1
        kk += uidx(1)


@cached
@cuda.jit
def gdn_chunk_scan_kernel(
    w, u, qs, kd, qk, cs, cu_seqlens, slots, has_initial, state_pool, out
):  # fmt: skip
    tile, h, seq = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    Dk, Dv = w.shape[2], u.shape[2]
    j0 = tile * COLS
    start, end = cu_seqlens[seq], cu_seqlens[seq + 1]
    slot = slots[seq]
    if slot < 0:  # padding: zeros out, state untouched (the whole block leaves)
        for p in range(tid, (end - start) * COLS, THREADS):
            t, jj = p // COLS, p % COLS
            if j0 + jj < Dv:
                out[start + t, h, j0 + jj] = 0.0
        return
    S = cuda.shared.array((MAX_DK, COLS), float32)
    vn = cuda.shared.array((CHUNK, COLS), float32)
    stage = cuda.shared.array(STAGE, float32)
    # Micro-tiles: rows tr * MT + r (r < MT) and columns tc + 16 c (c < 2); MT = 4 token rows in
    # V' and O, 8 state rows in the update. Shared memory is indexed with unsigned integers
    # (no negative-index wraparound code in the inner loops: see the module doc).
    tr, tc = tid // 16, tid % 16
    utc = uidx(tc)
    # A staging fill: thread tid holds (token tid // 32 + 8 m, column tid % 32), m < ITEMS.
    st_t, st_k = tid // SLICE, tid % SLICE
    kd_col = tid % MAX_DK  # the K' column this thread stages in the state update
    acc = cuda.local.array(16, float32)
    init = has_initial[seq]
    for m in range(STATE_ITEMS):
        p = tid + m * THREADS
        i, jj = p // COLS, p % COLS
        x = float32(0.0)
        if init and i < Dk and j0 + jj < Dv:
            x = state_pool[slot, h, i, j0 + jj]
        S[i, jj] = x
    t0 = start
    while t0 < end:
        L = min(CHUNK, end - t0)
        # V' = U - W S, then O = Q' S + P V' (P: the masked intra-chunk scores, zero above the
        # diagonal and past L, so the sum runs over the whole chunk).
        for phase in range(2):
            for e in range(8):
                acc[e] = 0.0
            nk = Dk if phase == 0 else Dk + CHUNK
            for k0 in range(0, nk, SLICE):
                # A slice whose K index lies inside one operand (B: S or V'): the A source (W,
                # Q' or P) and the first column of the slice in it (and row in B).
                in_s = k0 + SLICE <= Dk
                in_v = k0 >= Dk and k0 + SLICE <= nk
                src = w if phase == 0 else (qs if k0 < Dk else qk)
                c0 = k0 if k0 < Dk else k0 - Dk
                cuda.syncthreads()  # the previous readers of stage (and writers of S) are done
                if (in_s or in_v) and L == CHUNK:  # whole tile: straight-line loads
                    for m in range(ITEMS):
                        stage[uidx((st_t + 8 * m) * SLICE_LD + st_k)] = ld1(
                            src, (t0 + st_t + 8 * m, h, c0 + st_k)
                        )
                else:
                    for m in range(ITEMS):  # stage[t][kk] = W, Q' or P over 32 of the K index
                        t, kk = st_t + 8 * m, st_k
                        x = float32(0.0)
                        kx = k0 + kk
                        if t < L and kx < nk:
                            if phase == 0:
                                x = w[t0 + t, h, kx]
                            elif kx < Dk:
                                x = qs[t0 + t, h, kx]
                            else:
                                x = qk[t0 + t, h, kx - Dk]
                        stage[t * SLICE_LD + kk] = x
                cuda.syncthreads()
                if in_s:  # 32 K steps with no guard, at immediate shared offsets
                    _mac_slice(acc, stage, S, uidx(c0), utc, tr)
                elif in_v:
                    _mac_slice(acc, stage, vn, uidx(c0), utc, tr)
                else:
                    for kk in range(min(SLICE, nk - k0)):
                        kx = k0 + kk
                        b0 = float32(0.0)
                        b1 = float32(0.0)
                        if kx < Dk:
                            b0 = S[kx, tc]
                            b1 = S[kx, tc + 16]
                        else:
                            b0 = vn[kx - Dk, tc]
                            b1 = vn[kx - Dk, tc + 16]
                        for r in range(4):
                            a_ = stage[(tr * 4 + r) * SLICE_LD + kk]
                            acc[2 * r] += a_ * b0
                            acc[2 * r + 1] += a_ * b1
            for r in range(4):
                t = tr * 4 + r
                for c in range(2):
                    j = j0 + tc + 16 * c
                    if phase == 0:
                        x = float32(0.0)
                        if t < L and j < Dv:
                            x = u[t0 + t, h, j] - acc[2 * r + c]
                        vn[t, tc + 16 * c] = x
                    elif t < L and j < Dv:
                        out[t0 + t, h, j] = acc[2 * r + c]
        # S <- exp(c_L) S + K'^T V', K' staged 16 tokens at a time ([16][MAX_DK]).
        for e in range(16):
            acc[e] = 0.0
        for s0 in range(0, L, KT):
            cuda.syncthreads()
            full = s0 + KT <= L
            if full:  # the thread's column is the same for every m: one guard, outside
                if kd_col < Dk:
                    for m in range(KT * MAX_DK // THREADS):
                        p = tid + m * THREADS
                        stage[uidx(p)] = ld1(kd, (t0 + s0 + p // MAX_DK, h, kd_col))
                else:
                    for m in range(KT * MAX_DK // THREADS):
                        stage[uidx(tid + m * THREADS)] = 0.0
            else:
                for m in range(KT * MAX_DK // THREADS):
                    p = tid + m * THREADS
                    tt, i = p // MAX_DK, p % MAX_DK
                    x = float32(0.0)
                    if s0 + tt < L and i < Dk:
                        x = kd[t0 + s0 + tt, h, i]
                    stage[p] = x
            cuda.syncthreads()
            if full:  # 16 tokens with no guard, at immediate shared offsets
                for tt in range(KT):
                    vrow = uidx(s0) + uidx(tt)
                    b0 = vn[vrow, utc]
                    b1 = vn[vrow, utc + uidx(16)]
                    for r in range(8):
                        a_ = stage[uidx(tt * MAX_DK + tr * 8 + r)]
                        acc[2 * r] += a_ * b0
                        acc[2 * r + 1] += a_ * b1
            else:
                for tt in range(L - s0):
                    b0 = vn[s0 + tt, tc]
                    b1 = vn[s0 + tt, tc + 16]
                    for r in range(8):
                        a_ = stage[tt * MAX_DK + tr * 8 + r]
                        acc[2 * r] += a_ * b0
                        acc[2 * r + 1] += a_ * b1
        dl = float32(math.exp(cs[t0 + L - 1, h]))
        for r in range(8):
            i = tr * 8 + r
            S[i, tc] = S[i, tc] * dl + acc[2 * r]
            S[i, tc + 16] = S[i, tc + 16] * dl + acc[2 * r + 1]
        t0 += CHUNK
    cuda.syncthreads()
    for m in range(STATE_ITEMS):
        p = tid + m * THREADS
        i, jj = p // COLS, p % COLS
        if i < Dk and j0 + jj < Dv:
            state_pool[slot, h, i, j0 + jj] = S[i, jj]


def gated_delta_rule_prefill_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_initial: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as gated_delta_rule_prefill_ref; two launches, no host sync. Scratch:
    (3 Dk + Dv + 65) x 4 bytes per token and value head (Qwen3.5-27B: 123 KB a token)."""
    if not on_gpu(q):
        raise ValueError("gated_delta_rule_prefill_cuda needs CUDA tensors")
    check_shapes(q, v, state_pool)
    out = torch.empty_like(v)
    stream = current_stream()
    for kernel, grid, block, args in prefill_launches(
        q, k, v, a, b, A_log, dt_bias, state_pool, cu_seqlens, slots, has_initial, out,
        prefill_scratch(q, v),
    ):  # fmt: skip
        launch(kernel, grid, block, args, stream)
    return out


def prefill_scratch(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fp32 buffers the prep kernel writes and the scan kernel reads: (W, U, Q', K',
    scores, c), [T, Hv, n] each (c: [T, Hv])."""
    Dk = q.shape[2]
    T, Hv, Dv = v.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    return tuple(torch.empty(T, Hv, n, **f32) for n in (Dk, Dv, Dk, Dk, CHUNK)) + (
        torch.empty(T, Hv, **f32),
    )


def prefill_launches(
    q, k, v, a, b, A_log, dt_bias, state_pool, cu_seqlens, slots, has_initial, out, scratch
) -> list[tuple]:
    """(kernel, grid, block, args) of a prefill; scratch = (W, U, Q', K', scores, c) as the
    launcher allocates them (tests run the same list in the simulator)."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    N = slots.shape[0]
    if T == 0 or N == 0:
        return []
    w, u, qs, kd, qk, cs = scratch
    return [
        (
            gdn_chunk_prep_kernel,
            (T // CHUNK + N, Hv),
            THREADS,
            (q, k, v, a, b, A_log, dt_bias, cu_seqlens, slots, w, u, qs, kd, qk, cs,
             np.float32(Dk**-0.5)),
        ),
        (
            gdn_chunk_scan_kernel,
            ((Dv + COLS - 1) // COLS, Hv, N),
            THREADS,
            (w, u, qs, kd, qk, cs, cu_seqlens, slots, has_initial, state_pool, out),
        ),
    ]  # fmt: skip
