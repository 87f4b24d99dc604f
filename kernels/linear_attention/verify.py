"""Verify: a speculative verify step's rows walked in order inside one launch per state kind,
with the state after each row kept for the rollback (services/executor/state_rollback.py).

Layout (a verify graph's, `VerifyLayout`): B sequences of Q rows, row b * Q + j at position
start + j of sequence b; row_slots [B, Q] holds each row's state slot, -1 past the sequence's
live rows (a prefix: its last token and its proposals) and for every row of a padding sequence.
The pools are a state cache's whole rows (request slots and the snapshot area), and
snap_rows [B, >= Q - 1] names the row that keeps sequence b's state after its row j. Each
sequence's state is read once from its slot (row_slots[b, 0]); after live row j it is written
once: into snap_rows[b, j] when row j + 1 is live too, else (the last live row) back into the
slot. So the slot ends as a decode of every live row would leave it, and snapshot j holds the
state after row j for every j the commit can keep (kept - 1 < live rows - 1); the others are not
written. Rows that are not live get zeros.

Against the decode ops walked row by row (each row a launch per kind, the state read and written
back each time, then copied into its snapshot): one launch per kind, the recurrent state read
once and written once a row. For the Qwen3.5-27B shape (3 MiB of fp32 state a request and layer)
at Q = 4 that is 5 state passes instead of 14, and 2 launches a layer instead of about 30.

Kernels: the conv walks a thread's channel through the rows with the window in registers; the
gated delta rule is the decode kernel's block (recurrent.py: one request, value head and
32-column state tile, 4 warps of 32 rows) looping over the rows with the state tile in
registers. It addresses the state as [rows * Hv * Dk, Dv] from one per-warp base row a step:
indexed as [rows, Hv, Dk, Dv], the 32 row addresses of each store were kept live across the
row loop (about 200 registers for sm_70; 130 this way).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import cuda
from voltserve.kernels.linear_attention import conv, recurrent
from voltserve.kernels.linear_attention.conv import MAX_STATE
from voltserve.kernels.linear_attention.gating import gates
from voltserve.kernels.linear_attention.recurrent import COLS, L2_EPS, MAX_DK, ROWS, THREADS, WARPS
from voltserve.kernels.runtime.compile_cache import cached
from voltserve.kernels.runtime.launch_geometry import on_gpu
from voltserve.kernels.runtime.numba_common import (
    block_sum2,
    current_stream,
    float32,
    launch,
    uidx,
)
from voltserve.kernels.runtime.vec_io import ld1, st1


def _walk(row_slots: torch.Tensor, snap_rows: torch.Tensor, rows: torch.Tensor, step) -> None:
    """The reference walk: step(j, slots) advances row j of every sequence in place (slot -1:
    skipped); the state after row j is copied to snap_rows[b, j] when row j + 1 is live."""
    B, Q = row_slots.shape
    live = (row_slots >= 0).tolist()
    for j in range(Q):
        step(j, row_slots[:, j])
        for b in range(B):
            if j + 1 < Q and live[b][j] and live[b][j + 1]:
                rows[int(snap_rows[b, j])] = rows[int(row_slots[b, j])]


def _rows(Q: int, B: int, j: int, device) -> torch.Tensor:
    return torch.arange(B, device=device) * Q + j


def causal_conv1d_verify_ref(
    x: torch.Tensor,  # [B * Q, D]
    weight: torch.Tensor,  # [D, K]
    conv_rows: torch.Tensor,  # [rows, D, K - 1]: request slots and snapshot rows
    row_slots: torch.Tensor,  # [B, Q] int64
    snap_rows: torch.Tensor,  # [B, >= Q - 1] int64
) -> torch.Tensor:
    """silu(conv(x)) [B * Q, D] over each sequence's live rows (module doc); zeros elsewhere."""
    B, Q = row_slots.shape
    out = torch.zeros_like(x)

    def step(j, slots):
        r = _rows(Q, B, j, x.device)
        out[r] = conv.causal_conv1d_decode_ref(x[r], weight, conv_rows, slots)

    _walk(row_slots, snap_rows, conv_rows, step)
    return out


def gated_delta_rule_verify_ref(
    q: torch.Tensor,  # [B * Q, Hk, Dk]
    k: torch.Tensor,  # [B * Q, Hk, Dk]
    v: torch.Tensor,  # [B * Q, Hv, Dv]
    a: torch.Tensor,  # [B * Q, Hv]
    b: torch.Tensor,  # [B * Q, Hv]
    A_log: torch.Tensor,  # [Hv] fp32
    dt_bias: torch.Tensor,  # [Hv] fp32
    state_rows: torch.Tensor,  # [rows, Hv, Dk, Dv] fp32: request slots and snapshot rows
    row_slots: torch.Tensor,  # [B, Q] int64
    snap_rows: torch.Tensor,  # [B, >= Q - 1] int64
) -> torch.Tensor:
    """o [B * Q, Hv, Dv] of each sequence's live rows in order (module doc); zeros elsewhere."""
    B, Q = row_slots.shape
    out = torch.zeros_like(v)

    def step(j, slots):
        r = _rows(Q, B, j, v.device)
        out[r] = recurrent.gated_delta_rule_decode_ref(
            q[r], k[r], v[r], a[r], b[r], A_log, dt_bias, state_rows, slots
        )

    _walk(row_slots, snap_rows, state_rows, step)
    return out


@cached
@cuda.jit
def conv_verify_kernel(x, weight, conv_rows, row_slots, snap_rows, out):
    seq = cuda.blockIdx.x
    d = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    D, K1 = x.shape[1], conv_rows.shape[2]
    Q = row_slots.shape[1]
    if d >= D:
        return
    slot = row_slots[seq, 0]
    n = 0
    while n < Q and row_slots[seq, n] >= 0:
        n += 1
    for j in range(n, Q):
        out[seq * Q + j, d] = 0.0
    if n == 0:
        return
    win = cuda.local.array(MAX_STATE, float32)
    for i in range(K1):
        win[i] = float32(conv_rows[slot, d, i])
    for j in range(n):
        row = seq * Q + j
        xv = float32(x[row, d])
        acc = float32(weight[d, K1]) * xv
        for i in range(K1):
            acc += float32(weight[d, i]) * win[i]
        for i in range(K1 - 1):
            win[i] = win[i + 1]
        win[K1 - 1] = xv
        out[row, d] = conv.silu_rounded(acc, out)
        dst = slot
        if j + 1 < n:
            dst = snap_rows[seq, j]
        for i in range(K1):
            conv_rows[dst, d, i] = win[i]


@cached
@cuda.jit
def gdn_verify_kernel(q, k, v, a, b, a_log, dt_bias, flat, row_slots, snap_rows, out, scale):
    col_tile, h, seq = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    lane, warp = tid & 31, tid >> 5
    Dk, Dv, Hv = q.shape[2], v.shape[2], v.shape[1]
    Q = row_slots.shape[1]
    hk = h // (Hv // q.shape[1])
    j = col_tile * COLS + lane
    ok = j < Dv
    jc = min(j, Dv - 1)
    slot = row_slots[seq, 0]
    n = 0  # live rows (the same for every thread: the block's barriers stay uniform)
    while n < Q and row_slots[seq, n] >= 0:
        n += 1
    if warp == 0 and ok:
        for t in range(n, Q):
            out[seq * Q + t, h, j] = 0.0
    if n == 0:
        return
    row0 = warp * ROWS
    u0 = uidx(row0)
    nrows = max(min(Dk - row0, ROWS), 0)
    s = cuda.local.array(ROWS, float32)
    base = (slot * Hv + h) * Dk + row0  # this warp's first state row in `flat`
    if nrows == ROWS:
        for r in range(ROWS):
            s[r] = ld1(flat, (base + r, jc))
    else:
        for r in range(ROWS):
            x = float32(0.0)
            if r < nrows:
                x = ld1(flat, (base + r, jc))
            s[r] = x
    alog, dtb = a_log[h], dt_bias[h]
    qs = cuda.shared.array(MAX_DK, float32)
    ks = cuda.shared.array(MAX_DK, float32)
    part = cuda.shared.array((WARPS, COLS), float32)
    part2 = cuda.shared.array((WARPS, COLS), float32)
    scratch2 = cuda.shared.array((2, 32), float32)
    # Row 0's inputs now (their round trip overlaps the state tile's); each later row's are
    # loaded during the row before it.
    row = seq * Q
    qv = float32(0.0)
    kv = float32(0.0)
    if tid < Dk:
        qv = float32(q[row, hk, tid])
        kv = float32(k[row, hk, tid])
    vj = float32(v[row, h, jc])
    a_, b_ = a[row, h], b[row, h]
    for t in range(n):
        qq, kk = block_sum2(qv * qv, kv * kv, scratch2)
        qinv = float32(1.0) / math.sqrt(qq + float32(L2_EPS))
        kinv = float32(1.0) / math.sqrt(kk + float32(L2_EPS))
        qs[tid] = qv * qinv * scale
        ks[tid] = kv * kinv
        g, beta = gates(a_, b_, alog, dtb, b)
        decay = float32(math.exp(g)) if ok else float32(0.0)
        v_row = vj
        if t + 1 < n:
            nxt = row + 1
            if tid < Dk:
                qv = float32(q[nxt, hk, tid])
                kv = float32(k[nxt, hk, tid])
            vj = float32(v[nxt, h, jc])
            a_, b_ = a[nxt, h], b[nxt, h]
        cuda.syncthreads()

        acc = float32(0.0)
        for r in range(ROWS):
            x = s[r] * decay
            s[r] = x
            acc += x * ks[u0 + uidx(r)]
        part[warp, lane] = acc
        cuda.syncthreads()
        kvm = part[0, lane]
        for w in range(1, WARPS):
            kvm += part[w, lane]
        delta = float32(0.0)
        if ok:
            delta = (v_row - kvm) * beta
        acc = float32(0.0)
        for r in range(ROWS):
            sv = s[r] + ks[u0 + uidx(r)] * delta
            s[r] = sv
            acc += sv * qs[u0 + uidx(r)]
        # The state after this row: into its snapshot row while a live row follows, else back
        # into the slot (straight-line stores where the warp's rows all lie in the head).
        dst = slot
        if t + 1 < n:
            dst = snap_rows[seq, t]
        base = (dst * Hv + h) * Dk + row0
        if ok and nrows == ROWS:
            for r in range(ROWS):
                st1(flat, (base + r, j), s[r])
        elif ok:
            for r in range(ROWS):
                if r < nrows:
                    st1(flat, (base + r, j), s[r])
        part2[warp, lane] = acc
        cuda.syncthreads()
        if warp == 0 and ok:
            o = part2[0, lane]
            for w in range(1, WARPS):
                o += part2[w, lane]
            out[row, h, j] = o
        row += 1


def _check_layout(rows: int, row_slots: torch.Tensor, snap_rows: torch.Tensor) -> None:
    B, Q = row_slots.shape
    if rows != Q * B:
        raise ValueError(f"verify rows {rows}: want {Q} rows for each of {B} sequences")
    if snap_rows.shape[0] != B or snap_rows.shape[1] < Q - 1:
        raise ValueError(
            f"snapshot rows {tuple(snap_rows.shape)}: want [{B}, >= {Q - 1}] for {B} "
            f"sequences of {Q} rows"
        )


def conv_launches(x, weight, conv_rows, row_slots, snap_rows, out) -> list[tuple]:
    """(kernel, grid, block, args) of the conv walk (tests run the same list in the
    simulator)."""
    B, D = row_slots.shape[0], x.shape[1]
    if B == 0:
        return []
    args = (x, weight, conv_rows, row_slots, snap_rows, out)
    return [(conv_verify_kernel, (B, (D + conv.THREADS - 1) // conv.THREADS), conv.THREADS, args)]


def gdn_launches(
    q, k, v, a, b, A_log, dt_bias, state_rows, row_slots, snap_rows, out
) -> list[tuple]:
    """(kernel, grid, block, args) of the gated delta rule walk; the state as [rows * Hv * Dk,
    Dv] (module doc)."""
    B, Hv, Dv = row_slots.shape[0], v.shape[1], v.shape[2]
    if B == 0:
        return []
    scale = np.float32(q.shape[2] ** -0.5)
    flat = state_rows.view(-1, Dv)
    args = (q, k, v, a, b, A_log, dt_bias, flat, row_slots, snap_rows, out, scale)
    return [(gdn_verify_kernel, ((Dv + COLS - 1) // COLS, Hv, B), THREADS, args)]


def causal_conv1d_verify_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_rows: torch.Tensor,
    row_slots: torch.Tensor,
    snap_rows: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as causal_conv1d_verify_ref; one launch, no host sync (graph-safe)."""
    conv.check_shapes(x, weight, conv_rows)
    _check_layout(x.shape[0], row_slots, snap_rows)
    out = torch.empty_like(x)
    stream = current_stream()
    for kernel, grid, block, args in conv_launches(x, weight, conv_rows, row_slots, snap_rows, out):
        launch(kernel, grid, block, args, stream)
    return out


def gated_delta_rule_verify_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_rows: torch.Tensor,
    row_slots: torch.Tensor,
    snap_rows: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as gated_delta_rule_verify_ref; one launch, no host sync (graph-safe)."""
    if not on_gpu(q):
        raise ValueError("gated_delta_rule_verify_cuda needs CUDA tensors")
    recurrent.check_shapes(q, v, state_rows)
    if not state_rows.is_contiguous():
        raise ValueError("gated_delta_rule_verify_cuda needs contiguous state rows")
    _check_layout(q.shape[0], row_slots, snap_rows)
    out = torch.empty_like(v)
    stream = current_stream()
    for kernel, grid, block, args in gdn_launches(
        q, k, v, a, b, A_log, dt_bias, state_rows, row_slots, snap_rows, out
    ):
        launch(kernel, grid, block, args, stream)
    return out
