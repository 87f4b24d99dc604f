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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from voltserve.kernels.elementwise.activation import silu_and_mul_ref


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, K] (torch Linear layout), bias: [N] or None -> [M, N] in x's dtype."""
    return F.linear(x, w, bias)


def gemv_gate_up_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K], w: [2I, K] (gate rows then up rows) -> silu_and_mul(x @ w^T (+ bias)): [M, I].
    Never syncs with the host (a CUDA graph can capture it)."""
    return silu_and_mul_ref(F.linear(x, w, bias))


# ---------------------------------------------------------------------------------------------
# numba.cuda kernels

from numba import cuda  # noqa: E402
from voltserve.kernels.attention.rotary import _rot1  # noqa: E402
from voltserve.kernels.elementwise.activation import _silu_mul  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached_factory  # noqa: E402
from voltserve.kernels.runtime.launch_geometry import on_gpu  # noqa: E402
from voltserve.kernels.runtime.numba_common import (  # noqa: E402
    SIM,
    current_stream,
    float32,
    launch,
    named_kernel,
    round_like,
)
from voltserve.kernels.runtime.vec_io import VEC, ZERO8, dot8, ld8  # noqa: E402

MAX_M = 8
WARPS = 4  # warps per block
THREADS = 32 * WARPS
LANE_ELEMS = VEC  # elements a lane reads per chunk (one 16-byte load for fp16)
WARP_ELEMS = 32 * LANE_ELEMS  # elements a warp reads per chunk (256)

if SIM:
    from voltserve.kernels.attention.common import shfl_xor as _sim_shfl

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
    from voltserve.kernels.attention.common import shfl_bfly_ir

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


PLAIN, GATE_UP, QKV_ROPE = "plain", "gate_up", "qkv_rope"  # kernel kinds (see _source)
KINDS = (PLAIN, GATE_UP, QKV_ROPE)


def tile_for(m: int, kind: str = PLAIN) -> tuple[int, int]:
    """(R rows per warp, U chunks per lane per step) for M inputs.

    R * U = 8 loads of 16 bytes in flight per lane. Small M: one row a warp (more warps, better
    spread over the SMs). Larger M: two rows a warp, so each x chunk read (M of them per step)
    serves two weight rows and L1 traffic for x stays below the weight stream's. The paired kinds
    (gate_up, qkv_rope) always take two rows: the pair one output needs."""
    if kind != PLAIN:
        return (2, 4)
    return (1, 8) if m <= 2 else (2, 4)


# The qkv_rope kernels' shared lines (here and in quant_gemv.py), at one indent level inside
# the kernel. Prologue: the epilogue's position, slot and rotation factors do not depend on the
# sums, so they are loaded before the K loop, where their two dependent round trips (position,
# then cos/sin) overlap the weight stream instead of adding to the kernel's tail (every warp of
# the one wave waits for them at once). Lanes past the inputs read the last input's (unused).
QKV_ROPE_PROLOGUE = [
    "    lp = min(lane, Mx - 1)",
    "    pos = positions[lp]",
    "    slot = slots[lp]",
    "    rc = float32(0.0)",
    "    rs = float32(0.0)",
    "    if head < n_q + n_kv:",
    "        rc = round_like(cos_sin[pos, j], out)",
    "        rs = round_like(cos_sin[pos, half + j], out)",
]
# Store (lane m < M, holding input m's pair sums a, b with the bias added): rounded as the
# linear stores q/k/v, rotated as rotary.py rotates, written to out and (k, v) to the cache.
QKV_ROPE_STORE = [
    "        a = round_like(a, out)",
    "        b = round_like(b, out)",
    "        if head < n_q + n_kv:",
    "            a, b = _rot1(a, b, rc, rs, out)",
    "        out[lane, rw0] = a",
    "        out[lane, rw1] = b",
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
    gate_up, rope = kind == GATE_UP, kind == QKV_ROPE
    args = "x, w, bias, out, has_bias"
    if rope:
        args += ", positions, cos_sin, k_cache, v_cache, slots, n_q, n_kv"
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
    if rope:
        L += QKV_ROPE_PROLOGUE
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
        L += QKV_ROPE_STORE
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
    return "\n".join(L) + "\n"


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


def grid_for(m: int, n: int, kind: str = PLAIN) -> int:
    """Blocks for n weight rows (plain) or n row pairs (gate_up: n = I; qkv_rope: N / 2)."""
    r, _ = tile_for(variant_for(m), kind)
    rows_per_block = WARPS * (r if kind == PLAIN else 1)
    return (n + rows_per_block - 1) // rows_per_block


# ---------------------------------------------------------------------------------------------
# Host side

gemv_cuda_dtypes = (torch.float16, torch.float32)
gemv_gate_up_cuda_dtypes = gemv_cuda_dtypes


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % LANE_ELEMS == 0 for s in t.stride()[:-1])


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when the kernel covers this product (else use gemv_ref): CUDA tensors of one dtype,
    1 <= M <= 8, K a multiple of 8, unit stride along K, 16-byte aligned rows."""
    return (
        on_gpu(x)
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
        grid_for(M, rows if kind == PLAIN else rows // 2, kind),
        THREADS,
        (x, w, b, out, has_bias, *extra),
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
    "gemv_gate_up_ref",
    "gemv_cuda",
    "gemv_gate_up_cuda",
    "gemv_kernel",
    "supports",
    "supports_gate_up",
    "tile_for",
    "grid_for",
]
