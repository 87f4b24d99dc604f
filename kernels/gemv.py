"""Skinny matrix products for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) for M = 1..8.

At decode a linear layer reads its whole weight to produce a handful of rows, so it is a pure
weight stream: its time is N * K * 2 bytes over the HBM bandwidth, and cuBLAS, tuned for GEMMs,
reaches only part of that at M = 1. This kernel is written for the stream alone:

- one warp owns R consecutive output rows (R weight rows) for every one of the M inputs;
- each lane reads 16 bytes (8 fp16) of each weight row per chunk, U chunks per step, and issues
  all R * U loads of a step before the first multiply, so R * U * 16 bytes per lane are in flight
  (a 4-warp block with R * U = 8: 16 KB; several blocks per SM);
- x is read from global memory next to its use (it is a few KB, so every warp after the first
  hits L1/L2), widened to fp32, and multiplied in fp32; each lane's partial sums are reduced with
  warp shuffles and written (+ bias, in fp32) with one rounding to the output dtype;
- K must be a multiple of 8 and rows 16-byte aligned (checked on the host; otherwise the caller
  falls back to torch). A last partial step is guarded chunk by chunk.

M, R and U are compile-time constants: one kernel per M in (1, 2, 4, 8), built on first use
(`gemv_kernel(M)`; M = 3 runs the M = 4 kernel, which skips the missing row), so the per-lane
accumulators and the in-flight loads stay in registers (no local memory).

Rounding: fp32 accumulation in a different order than cuBLAS, so fp16 outputs can differ from
torch by an ulp or two; the reference is `gemv_ref` (torch's linear).

The gate_up variant (`gemv_gate_up_cuda`, reference `gemv_gate_up_ref`) produces the MLP's
activation directly: h[M, I] = silu(x @ Wg^T) * (x @ Wu^T) for the merged gate_up weight [2I, K]
(gate rows, then up rows). A warp owns gate row j and up row I + j (R = 2), so both sums of h[j]
end in the same warp; they are rounded to the storage dtype as the linear would store them, and
h is rounded exactly as the silu_and_mul kernel rounds it (silu first, then the product). The
separate activation launch (latency-bound at decode: ~3 us of a ~57 us gate_up) is gone, and no
[M, 2I] intermediate is written. (A first attempt fused silu into the down projection's input
instead: every warp recomputed h for its K chunks, and it lost to the plain GEMV, 58 vs 35 us.)

The add_norm variant (`gemv_add_rms_norm_cuda`, reference `gemv_add_rms_norm_ref`) is the plain
GEMV followed by the residual add + RMSNorm that consumes its output (o_proj -> post-attention
norm, down_proj -> the next layer's input norm): at decode that norm is a ~3 us latency-bound
launch of its own. Every block writes its outputs, fences, and takes a ticket on an int32
counter; the block that draws the last one resets the counter (zero at rest, so graph replays
need no memset), fences again, and runs the norm over all M rows (`_add_norm_tail`): y read
back through L2 (ld8_cg), residual += y and the normalised rows written over y, rounded and
summed exactly as rmsnorm's one-chunk kernel does (its per-warp butterflies, then its warps in
order), so the outputs are the same bits as the two launches. (Folding the norm into the next
GEMV's prologue instead was tried and lost, PERF_NOTES: every warp renormalised the row.)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from voltserve.kernels.activation import silu_and_mul_ref
from voltserve.kernels.rmsnorm import fused_add_rms_norm_ref


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, K] (torch Linear layout), bias: [N] or None -> [M, N] in x's dtype."""
    return F.linear(x, w, bias)


def gemv_add_rms_norm_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    counter: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ w^T (+ bias), then fused_add_rms_norm(y, residual, weight, eps): residual += y in
    place, and the returned y holds rms_norm(residual) * weight. counter: the fused kernel's
    arrival counter (unused here). Never syncs with the host."""
    y = gemv_ref(x, w, bias)
    fused_add_rms_norm_ref(y, residual, weight, eps)
    return y


def gemv_gate_up_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K], w: [2I, K] (gate rows then up rows) -> silu_and_mul(x @ w^T (+ bias)): [M, I].
    Never syncs with the host (a CUDA graph can capture it)."""
    return silu_and_mul_ref(F.linear(x, w, bias))


# ---------------------------------------------------------------------------------------------
# numba.cuda kernels

from numba import cuda  # noqa: E402
from voltserve.kernels.activation import _silu_mul  # noqa: E402
from voltserve.kernels.compile_cache import cached_factory  # noqa: E402
from voltserve.kernels.numba_common import (  # noqa: E402
    SIM,
    current_stream,
    dev,
    float32,
    int32,
    launch,
    named_kernel,
    nvvm_inlined,
    round_like,
)
from voltserve.kernels.rmsnorm import (  # noqa: E402
    ONE_CHUNK_MAX_THREADS,
    _add8,
    _scale8,
    _sq8,
    fused_add_rms_norm_cuda,
    inv_rms_of,
)
from voltserve.kernels.rotary import _rot1  # noqa: E402
from voltserve.kernels.vec_io import VEC, ZERO8, dot8, ld8, ld8_cg, st8, vec_ok  # noqa: E402

MAX_M = 8
WARPS = 4  # warps per block
THREADS = 32 * WARPS
LANE_ELEMS = VEC  # elements a lane reads per chunk (one 16-byte load for fp16)
WARP_ELEMS = 32 * LANE_ELEMS  # elements a warp reads per chunk (256)

if SIM:
    from voltserve.kernels.attention_common import shfl_xor as _sim_shfl

    @cuda.jit(device=True)
    def _warp_sum(v):
        # The simulator's exchange is exact when a block is one warp (tests launch 32 threads).
        off = 16
        while off > 0:
            v += _sim_shfl(v, off)
            off >>= 1
        return v

else:
    from numba import types
    from numba.cuda.extending import intrinsic
    from voltserve.kernels.attention_common import shfl_bfly_ir

    @intrinsic
    def _warp_sum(typingctx, v):
        """v += shfl_xor(v, 16), ... 8, 4, 2, 1 (every lane ends with the warp's sum), emitted
        as numba lowers those five statements. An intrinsic, not an inlined device function:
        numba re-runs its liveness analysis over the whole caller for every call it inlines,
        and the generated GEMVs reduce up to 32 accumulators each."""
        if v != types.float32:
            return None

        def codegen(context, builder, signature, args):
            (x,) = args
            for off in (16, 8, 4, 2, 1):
                x = builder.fadd(x, shfl_bfly_ir(builder, x, off))
            return x

        return types.float32(v), codegen


# Kernel kinds (see _source). add_norm is the plain GEMV with the add + RMSNorm epilogue.
PLAIN, GATE_UP, QKV_ROPE, ADD_NORM = "plain", "gate_up", "qkv_rope", "add_norm"
KINDS = (PLAIN, GATE_UP, QKV_ROPE, ADD_NORM)
ROW_KINDS = (PLAIN, ADD_NORM)  # one output per weight row


# ---- The add + RMSNorm epilogue, run by the last block of an add_norm launch ----------------
# It repeats rmsnorm.fused_add_rms_norm_1c_kernel's arithmetic in the same order, so that the
# fused and the unfused paths give the same bits: that kernel gives 8-element chunk c of a row
# to thread c / 8, sums each thread's squares with _sq8, each warp's 32 sums with butterflies,
# and the warps' totals one after the other (numba_common.block_sum). Here a thread takes
# chunks tid, tid + bd, ... (bd a multiple of 32), so each warp holds 32 consecutive chunks,
# one of that kernel's warps, in the same lanes; its butterfly total goes to part[c / 256].
# The simulator's block_sum adds the threads' sums one by one instead: part keeps each chunk's.
EPI_CHUNKS = 2  # chunks of a row a tail thread loads at once (2 x 128 x 8 = 2048 elements)

if SIM:
    PART = ONE_CHUNK_MAX_THREADS

    @cuda.jit(device=True)
    def _publish(ss, part, c, n):
        if c < n:
            part[c >> 3] = ss

    @cuda.jit(device=True)
    def _row_total(part, n):
        total = float32(0.0)
        for i in range((n + VEC - 1) // VEC):
            total += part[i]
        return total

else:
    PART = 32  # warps of the one-chunk kernel's widest block (8192 elements)

    @cuda.jit(device=True, inline="always")
    def _publish(ss, part, c, n):
        t = _warp_sum(ss)
        if (cuda.threadIdx.x & 31) == 0 and c < n:
            part[c >> 8] = t

    @cuda.jit(device=True, inline="always")
    def _row_total(part, n):
        total = part[0]
        for i in range(1, (n + 255) >> 8):
            total += part[i]
        return total


@cuda.jit(device=True, inline="always")
def _add_norm_rows(out, residual, weight, eps):
    """For every row m of out (the GEMV's y, written by every block of the launch):
    residual[m] += y[m]; out[m] = rms_norm(residual[m]) * weight. Called by the whole last
    block (its loops and barriers are uniform across it)."""
    tid, bd = cuda.threadIdx.x, cuda.blockDim.x
    n = out.shape[1]
    part = cuda.shared.array(PART, float32)
    step = EPI_CHUNKS * bd * VEC
    for m in range(out.shape[0]):
        g = 0
        while g < n:
            c0 = g + tid * VEC
            c1 = c0 + bd * VEC
            # Every load of the group before the first use (one round trip); y through L2.
            r0 = ld8(residual, (m, c0)) if c0 < n else ZERO8
            r1 = ld8(residual, (m, c1)) if c1 < n else ZERO8
            y0 = ld8_cg(out, (m, c0)) if c0 < n else ZERO8
            y1 = ld8_cg(out, (m, c1)) if c1 < n else ZERO8
            s0 = _add8(r0, y0, residual)
            s1 = _add8(r1, y1, residual)
            if c0 < n:
                st8(residual, (m, c0), s0)
            if c1 < n:
                st8(residual, (m, c1), s1)
            _publish(_sq8(s0), part, c0, n)
            _publish(_sq8(s1), part, c1, n)
            g += step
        cuda.syncthreads()
        inv = inv_rms_of(_row_total(part, n), n, eps)
        g = 0
        while g < n:
            c0 = g + tid * VEC
            c1 = c0 + bd * VEC
            # This thread stored these residual chunks above, so reading them back is ordered.
            r0 = ld8(residual, (m, c0)) if c0 < n else ZERO8
            r1 = ld8(residual, (m, c1)) if c1 < n else ZERO8
            w0 = ld8(weight, (c0,)) if c0 < n else ZERO8
            w1 = ld8(weight, (c1,)) if c1 < n else ZERO8
            if c0 < n:
                st8(out, (m, c0), _scale8(r0, w0, inv, out))
            if c1 < n:
                st8(out, (m, c1), _scale8(r1, w1, inv, out))
            g += step
        cuda.syncthreads()  # the next row writes part again


_add_norm_tail = nvvm_inlined(_add_norm_rows)


# The ticket (as decode_attention._emit_merge): each thread's y stores are made visible
# device-wide (fence) before thread 0 takes a ticket; the winner resets the counter (every other
# block has taken its ticket) and fences again before the tail reads the other blocks' y.
_ADD_NORM_EPILOGUE = """\
    cuda.threadfence()
    cuda.syncthreads()
    flag = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        flag[0] = 0
        if cuda.atomic.add(counter, 0, 1) == cuda.gridDim.x - 1:
            flag[0] = 1
            counter[0] = 0
    cuda.syncthreads()
    if flag[0] == 0:
        return
    cuda.threadfence()
    _add_norm_tail(out, residual, norm_w, eps)
"""


def tile_for(m: int, kind: str = PLAIN) -> tuple[int, int]:
    """(R rows per warp, U chunks per lane per step) for M inputs.

    R * U = 8 loads of 16 bytes in flight per lane. Small M: one row a warp (more warps, better
    spread over the SMs). Larger M: two rows a warp, so each x chunk read (M of them per step)
    serves two weight rows and L1 traffic for x stays below the weight stream's. The paired kinds
    (gate_up, qkv_rope) always take two rows: the pair one output needs."""
    if kind not in ROW_KINDS:
        return (2, 4)
    return (1, 8) if m <= 2 else (2, 4)


def _source(M: int, R: int, U: int, kind: str = PLAIN) -> str:
    """The kernel for one (M, R, U), written out statement by statement.

    Generated rather than written with `for` loops over M, R and U: LLVM unrolls such loops only
    below its size threshold, and a loop it keeps turns the accumulators and the in-flight loads
    into local-memory arrays (and serialises the loads). Written out, every one is a register.

    gate_up: w is [2I, K], out [M, I]; the warp's two rows are j and I + j, and lane m writes
    h[m, j] = silu(gate) * up from the two sums.
    qkv_rope: w is the fused qkv weight, out [M, N]; the warp's two rows are dims j and j + D/2
    of one head (a NeoX rotary pair), and lane m rotates q and k rows at positions[m] and writes
    them, and v, to out and (k, v) to the paged cache at slot_mapping[m] (gemv_qkv_rope.py)."""
    if kind not in KINDS:
        raise ValueError(f"gemv kind {kind!r} is not one of {KINDS}")
    gate_up, rope, add_norm = kind == GATE_UP, kind == QKV_ROPE, kind == ADD_NORM
    args = "x, w, bias, out, has_bias"
    if rope:
        args += ", positions, cos_sin, k_cache, v_cache, slots, n_q, n_kv"
    if add_norm:
        args += ", residual, norm_w, eps, counter"
    step = U * WARP_ELEMS
    acc = [f"a{m}_{r}" for m in range(M) for r in range(R)]
    L = [
        f"def kernel({args}):",
        "    lane = cuda.threadIdx.x & 31",
        "    warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> 5",
        "    K = w.shape[1]",
    ]
    if gate_up:
        L += [
            "    N = w.shape[0] >> 1  # outputs: one per gate/up row pair",
            "    row0 = warp",
            "    if row0 >= N:",
            "        return  # the whole warp leaves together: the shuffles stay full-mask",
            "    rw0 = row0",
            "    rw1 = row0 + N",
        ]
    elif rope:
        L += [
            "    D = k_cache.shape[3]",
            "    half = D >> 1",
            "    if warp >= w.shape[0] >> 1:",
            "        return  # the whole warp leaves together: the shuffles stay full-mask",
            "    head = warp // half",
            "    j = warp - head * half",
            "    rw0 = head * D + j",
            "    rw1 = rw0 + half",
        ]
    else:
        L += [
            "    N = w.shape[0]",
            f"    row0 = warp * {R}",
            "    if row0 >= N:",
            "        return  # the whole warp leaves together: the shuffles stay full-mask",
        ]
        # A partial last group of rows re-reads row N-1 (never written): no guard in the loop.
        L += [f"    rw{r} = min(row0 + {r}, N - 1)" for r in range(R)]
    # Fewer inputs than the variant's M: the missing rows re-read the last one (L1 hits) and
    # their outputs are not written.
    L.append("    Mx = x.shape[0]")
    L += [f"    xm{m} = min({m}, Mx - 1)" for m in range(1, M)]
    L += [f"    {a} = float32(0.0)" for a in acc]
    L += [f"    lc = lane * {LANE_ELEMS}", "    k0 = 0"]

    def body(indent: str, guarded: bool) -> list[str]:
        g = "t" if guarded else ""  # the tail's temporaries: names of their own too
        out = [f"{indent}c{g}{j} = k0 + lc + {j * WARP_ELEMS}" for j in range(U)]
        # Every weight load of the step before the first use: R * U * 16 bytes in flight.
        for r in range(R):
            for j in range(U):
                if guarded:
                    # Guards written out, not an inlined helper (see vec_io.dot8).
                    out.append(
                        f"{indent}w{g}{r}_{j} = ld8(w, (rw{r}, c{g}{j})) if c{g}{j} < K else ZERO8"
                    )
                else:
                    out.append(f"{indent}w{g}{r}_{j} = ld8(w, (rw{r}, c{g}{j}))")
        # Then x chunk by chunk (L1/L2 hits), each used for all R rows.
        for j in range(U):
            for m in range(M):
                xm = f"xm{m}" if m else "0"
                # A name per (chunk, row): numba rebuilds SSA form over the whole kernel for
                # every name assigned more than once (compile time only; the PTX is the same).
                xv = f"xv{g}{j}_{m}"
                if guarded:
                    out.append(f"{indent}{xv} = ld8(x, ({xm}, c{g}{j})) if c{g}{j} < K else ZERO8")
                else:
                    out.append(f"{indent}{xv} = ld8(x, ({xm}, c{g}{j}))")
                for r in range(R):
                    out.append(f"{indent}a{m}_{r} = dot8(a{m}_{r}, {xv}, w{g}{r}_{j})")
        return out

    L.append(f"    while k0 + {step} <= K:")
    L += body("        ", False)
    L.append(f"        k0 += {step}")
    L.append("    if k0 < K:")
    L += body("        ", True)
    if rope or gate_up:
        # Butterfly sums of the warp's two rows; lane m keeps input m's pair (a, b), biased.
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
        if gate_up:
            L += [
                "        # As the linear stores gate and up, then as silu_and_mul rounds h.",
                "        out[lane, row0] = _silu_mul(round_like(a, out), round_like(b, out), out)",
            ]
            return "\n".join(L) + "\n"
        L += [
            "        # Rounded as the linear stores q/k/v, then rotated as rotary.py rotates.",
            "        a = round_like(a, out)",
            "        b = round_like(b, out)",
            "        if head < n_q + n_kv:",
            "            pos = positions[lane]",
            "            c = round_like(cos_sin[pos, j], out)",
            "            s = round_like(cos_sin[pos, half + j], out)",
            "            a, b = _rot1(a, b, c, s, out)",
            "        out[lane, rw0] = a",
            "        out[lane, rw1] = b",
            "        slot = slots[lane]",
            "        if head >= n_q and slot >= 0:",
            "            bs = k_cache.shape[2]",
            "            blk = slot // bs",
            "            off = slot - blk * bs",
            "            if head < n_q + n_kv:",
            "                k_cache[blk, head - n_q, off, j] = a",
            "                k_cache[blk, head - n_q, off, j + half] = b",
            "            else:",
            "                v_cache[blk, head - n_q - n_kv, off, j] = a",
            "                v_cache[blk, head - n_q - n_kv, off, j + half] = b",
        ]
        return "\n".join(L) + "\n"
    # Butterfly sums: every lane ends with every total; lane i writes output i = m * R + r.
    L.append("    mine = float32(0.0)")
    for i, a in enumerate(acc):
        L.append(f"    t = _warp_sum({a})")
        L.append(f"    if lane == {i}:")
        L.append("        mine = t")
    L += [
        f"    if lane < {M * R}:",
        f"        row = row0 + lane % {R}",
        f"        if row < N and lane // {R} < Mx:",
        "            if has_bias:",
        "                mine += float32(bias[row])",
    ]
    L.append(f"            out[lane // {R}, row] = mine")
    if not add_norm:
        return "\n".join(L) + "\n"
    # Every warp must reach the ticket: the early return becomes a guard around the product.
    i = L.index("    if row0 >= N:")
    body = ["    " + line for line in L[i + 2 :]]
    L = L[:i] + ["    if row0 < N:"] + body
    return "\n".join(L) + "\n" + _ADD_NORM_EPILOGUE


@cached_factory
def _build(M: int, R: int, U: int, kind: str = PLAIN):
    scope = {
        "cuda": cuda,
        "float32": float32,
        "ld8": ld8,
        "ZERO8": ZERO8,
        "dot8": dot8,
        "_warp_sum": _warp_sum,
        "_silu_mul": _silu_mul,
        "round_like": round_like,
        "_rot1": _rot1,
        "int32": int32,
        "_add_norm_tail": _add_norm_tail,
    }
    name = f"<gemv {kind} M={M} R={R} U={U}>"
    code = compile(_source(M, R, U, kind), name, "exec")
    exec(code, scope)  # noqa: S102 - our own generated source, see _source
    return cuda.jit(named_kernel(scope["kernel"], __name__, f"gemv_{kind}_m{M}_r{R}_u{U}"))


_KERNELS: dict[tuple[int, str], object] = {}  # (variant M, kind)


VARIANTS = (1, 2, 4, 8)  # compiled M values; other M use the next larger one


def variant_for(m: int) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv kernels cover M = 1..{MAX_M}, got {m}")
    return next(v for v in VARIANTS if v >= m)


def gemv_kernel(m: int, kind: str = PLAIN):
    """The kernel of `kind` that serves M = m inputs (the M = variant_for(m) kernel, built
    once): plain, gate_up (w a merged gate_up weight, out the activation) or qkv_rope."""
    v = variant_for(m)
    key = (v, kind)
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = _build(v, *tile_for(v, kind), kind)
    return k


# Representative instances for `voltserve check-kernels` (kernels/registry.py).
gemv_kernel_m1 = gemv_kernel(1)
gemv_kernel_m2 = gemv_kernel(2)
gemv_kernel_m4 = gemv_kernel(4)
gemv_kernel_m8 = gemv_kernel(8)
gemv_gate_up_kernel_m1 = gemv_kernel(1, GATE_UP)
gemv_gate_up_kernel_m2 = gemv_kernel(2, GATE_UP)
gemv_gate_up_kernel_m4 = gemv_kernel(4, GATE_UP)
gemv_gate_up_kernel_m8 = gemv_kernel(8, GATE_UP)
gemv_qkv_rope_kernel_m1 = gemv_kernel(1, QKV_ROPE)
gemv_qkv_rope_kernel_m2 = gemv_kernel(2, QKV_ROPE)
gemv_add_norm_kernel_m1 = gemv_kernel(1, ADD_NORM)
gemv_add_norm_kernel_m2 = gemv_kernel(2, ADD_NORM)
gemv_add_norm_kernel_m4 = gemv_kernel(4, ADD_NORM)
gemv_add_norm_kernel_m8 = gemv_kernel(8, ADD_NORM)


def grid_for(m: int, n: int, kind: str = PLAIN) -> int:
    """Blocks for n weight rows (plain) or n row pairs (gate_up: n = I; qkv_rope: N / 2)."""
    r, _ = tile_for(variant_for(m), kind)
    rows_per_block = WARPS * (r if kind in ROW_KINDS else 1)
    return (n + rows_per_block - 1) // rows_per_block


# ---------------------------------------------------------------------------------------------
# Host side

gemv_cuda_dtypes = (torch.float16, torch.float32)
gemv_gate_up_cuda_dtypes = gemv_cuda_dtypes
gemv_add_rms_norm_cuda_dtypes = gemv_cuda_dtypes


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % LANE_ELEMS == 0 for s in t.stride()[:-1])


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when the kernel covers this product (else use gemv_ref): CUDA tensors of one dtype,
    1 <= M <= 8, K a multiple of 8, unit stride along K, 16-byte aligned rows."""
    return (
        x.is_cuda
        and x.dim() == 2
        and w.dim() == 2
        and x.dtype == w.dtype
        and x.dtype in gemv_cuda_dtypes
        and 1 <= x.shape[0] <= MAX_M
        and x.shape[1] == w.shape[1]
        and w.shape[1] % LANE_ELEMS == 0
        and x.stride(-1) == 1
        and w.stride(-1) == 1
        and _aligned(x)
        and _aligned(w)
    )


def supports_gate_up(x: torch.Tensor, w: torch.Tensor) -> bool:
    """`supports` for gemv_gate_up: w [2I, K] has an even number of rows."""
    return w.dim() == 2 and w.shape[0] % 2 == 0 and supports(x, w)


def supports_add_norm(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> bool:
    """`supports`, and what the add + norm epilogue needs: residual [M, N] and weight [N] on
    x's device and of its dtype, readable 8 elements at a time, and rows the one-chunk norm
    kernel would take (N <= 8192), whose summation order the epilogue repeats."""
    n = w.shape[0]
    return (
        supports(x, w)
        and residual.device == x.device
        and weight.device == x.device
        and residual.dtype == x.dtype
        and weight.dtype == x.dtype
        and tuple(residual.shape) == (x.shape[0], n)
        and tuple(weight.shape) == (n,)
        and n <= ONE_CHUNK_MAX_THREADS * VEC
        and vec_ok(residual, weight)
    )


def launch_gemv(x, w, bias, out, kind: str = PLAIN, extra: tuple = ()) -> torch.Tensor:
    """One launch of the `kind` kernel for inputs its caller checked. out: the output, or None
    for a new one ([M, outputs]); extra: the kind's arguments after has_bias (qkv_rope's,
    already converted). Every gemv launcher (here and gemv_qkv_rope.py) goes through it."""
    M, rows = x.shape[0], w.shape[0]
    if out is None:  # gate_up writes one activation per row pair; the others a column per row
        cols = rows // 2 if kind == GATE_UP else rows
        out = torch.empty((M, cols), dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    b = bias if has_bias else w[0]  # any 1-D array of the dtype; not read without a bias
    launch(
        gemv_kernel(M, kind),
        grid_for(M, rows if kind in ROW_KINDS else rows // 2, kind),
        THREADS,
        (dev(x), dev(w), dev(b), dev(out), has_bias, *extra),
        current_stream(),
    )
    return out


def _run(x, w, bias, out, kind: str, ok: bool, ref) -> torch.Tensor:
    """Launch the `kind` kernel for what the caller's `supports` check accepted (ok), or
    compute `ref` (into out when given)."""
    if not ok:
        if out is None:
            return ref(x, w, bias)
        out.copy_(ref(x, w, bias))
        return out
    return launch_gemv(x, w, bias, out, kind)


def gemv_cuda(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same meaning as gemv_ref for what `supports` accepts (anything else goes to gemv_ref).
    Launches on torch's current stream without a host sync, so it can be graph-captured."""
    return _run(x, w, bias, out, PLAIN, supports(x, w), gemv_ref)


def gemv_add_rms_norm_cuda(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    counter: torch.Tensor,
) -> torch.Tensor:
    """Same meaning as gemv_add_rms_norm_ref: one launch where `supports_add_norm` holds (the
    norm is the last block's epilogue), else the GEMV and fused_add_rms_norm launchers one after
    the other (the same bits either way). counter: int32 [1] on x's device, zero at rest (the
    launch leaves it zero); launches sharing one must not run concurrently. Never syncs."""
    if not supports_add_norm(x, w, residual, weight):
        y = gemv_cuda(x, w, bias)
        norm = fused_add_rms_norm_cuda if y.is_cuda else fused_add_rms_norm_ref
        norm(y, residual, weight, eps)
        return y
    extra = (dev(residual), dev(weight), np.float32(eps), dev(counter))
    return launch_gemv(x, w, bias, None, ADD_NORM, extra)


def gemv_gate_up_cuda(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same meaning as gemv_gate_up_ref for what `supports_gate_up` accepts (anything else goes
    to gemv_gate_up_ref). Launches on torch's current stream without a host sync."""
    return _run(x, w, bias, out, GATE_UP, supports_gate_up(x, w), gemv_gate_up_ref)


__all__ = [
    "gemv_ref",
    "gemv_add_rms_norm_ref",
    "gemv_add_rms_norm_cuda",
    "supports_add_norm",
    "gemv_gate_up_ref",
    "gemv_cuda",
    "gemv_gate_up_cuda",
    "gemv_kernel",
    "supports",
    "supports_gate_up",
    "tile_for",
    "grid_for",
]
