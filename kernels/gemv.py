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

Pre-norm variants (`gemv_prenorm_cuda`, `gemv_gate_up_prenorm_cuda`, and the qkv_rope one in
gemv_qkv_rope.py; M = 1 and 2) fold the decoder layer's `fused_add_rms_norm` into the GEMV that
reads its output, so its launch (~2.8 us, twice per layer: 64 per Llama-3-8B step) is gone. Every
block runs a prologue before its GEMV: its threads read the x and residual rows in 16-byte
chunks, form h = residual + x in the storage dtype (block 0 also stores h to residual_out),
reduce sum(h^2) in fp32 over the block, and write xn = rms_norm(h) * norm_w, rounded as
`rms_norm_ref` rounds, into dynamic shared memory (M * K * itemsize bytes, at most 48 KiB with
the reduction's 128-byte scratch, so no opt-in attribute and nothing to set before a graph
capture). The GEMV loop then reads x from there. The first step's weight loads are issued
before the prologue, so its work overlaps their round trip; warps past the last row take part
in the prologue's barriers and leave after them. The cost: every block re-reads the rows,
(4M + 2) * K bytes (fp16 x, residual, norm weight) of L2 (or L1) hits against its 2 * rows * K
bytes of weight from HBM (rows = 4 plain, 8 paired per 4-warp block: 37-125% more bytes moved,
though not from HBM); `PRENORM_WARPS` (wider blocks) divides it. Reference: `gemv_prenorm_ref`
(fused_add_rms_norm_ref, then the kind's linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from voltserve.kernels.activation import silu_and_mul_ref
from voltserve.kernels.rmsnorm import fused_add_rms_norm_ref


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, K] (torch Linear layout), bias: [N] or None -> [M, N] in x's dtype."""
    return F.linear(x, w, bias)


def gemv_gate_up_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K], w: [2I, K] (gate rows then up rows) -> silu_and_mul(x @ w^T (+ bias)): [M, I].
    Never syncs with the host (a CUDA graph can capture it)."""
    return silu_and_mul_ref(F.linear(x, w, bias))


def prenorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor,
) -> torch.Tensor:
    """The pre-norm half of the fused ops: residual_out <- residual + x (in the storage dtype),
    returns xn = rms_norm(residual_out) * norm_w, both exactly as fused_add_rms_norm_ref computes
    them. Safe when residual_out aliases x or residual (x is copied first)."""
    xn = x.clone()
    residual_out.copy_(residual)
    fused_add_rms_norm_ref(xn, residual_out, norm_w, eps)
    return xn


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def gemv_prenorm_ref(
    x: torch.Tensor,  # [M, K]: the layer's input (attention or MLP output)
    residual: torch.Tensor,  # [M, K]
    norm_w: torch.Tensor,  # [K]
    eps: float,
    w: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    *,
    residual_out: torch.Tensor,  # [M, K]: receives residual + x
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_add_rms_norm then the linear: residual_out <- residual + x; returns
    rms_norm(residual_out) * norm_w @ w^T (+ bias) [M, N] (written into out when given). x and
    residual are left as they are. Never syncs with the host."""
    return _into(gemv_ref(prenorm_ref(x, residual, norm_w, eps, residual_out), w, bias), out)


def gemv_gate_up_prenorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    w: torch.Tensor,  # [2I, K]: gate rows then up rows
    bias: torch.Tensor | None = None,
    *,
    residual_out: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_add_rms_norm then gemv_gate_up_ref: residual_out <- residual + x; returns the
    activation [M, I] of the normalised input. Never syncs with the host."""
    xn = prenorm_ref(x, residual, norm_w, eps, residual_out)
    return _into(gemv_gate_up_ref(xn, w, bias), out)


# ---------------------------------------------------------------------------------------------
# numba.cuda kernels

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402
from voltserve.kernels.activation import _silu_mul  # noqa: E402
from voltserve.kernels.compile_cache import cached_factory  # noqa: E402
from voltserve.kernels.numba_common import (  # noqa: E402
    SIM,
    current_stream,
    dev,
    float32,
    launch,
    named_kernel,
    round_like,
)
from voltserve.kernels.rmsnorm import _add8, _inv_rms, _scale8  # noqa: E402
from voltserve.kernels.rotary import _rot1  # noqa: E402
from voltserve.kernels.vec_io import VEC, ZERO8, dot8, ld8, st8, vec_ok  # noqa: E402

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


# 16-byte accesses to the pre-norm variants' shared x rows. vec_io's ld8/st8 cast their pointer
# to the global address space, which is wrong for a shared array (numba hands the kernel a
# generic pointer to it): these cast to the shared space, so PTX has ld/st.shared.v4.
if SIM:

    def _lds8(arr, i):
        """arr[i : i + 8] of a 1-D shared array as 8 float32 (i a multiple of 8)."""
        return ld8(arr, (i,))

    def _sts8(arr, i, vals):
        """arr[i : i + 8] = vals, each rounded to arr's dtype."""
        st8(arr, (i,), vals)

else:
    from llvmlite import ir
    from numba.cuda import cgutils

    _SHARED = 3  # NVPTX address space of shared memory

    def _shared_ptrs(context, builder, arr_ty, arr, i_ty, i) -> list:
        """Shared-space pointers to the 16-byte pieces of arr[i : i + 8]: one for fp16, two
        (4 floats each) for fp32."""
        ary = context.make_array(arr_ty)(context, builder, value=arr)
        ptr = cgutils.get_item_pointer(
            context,
            builder,
            arr_ty,
            ary,
            [context.cast(builder, i, i_ty, types.intp)],
            wraparound=False,
        )
        half = arr_ty.dtype == types.float16
        vty = ir.VectorType(ir.IntType(32), 4) if half else ir.VectorType(ir.FloatType(), 4)
        parts = (
            [ptr]
            if half
            else [builder.gep(ptr, [ir.Constant(ir.IntType(64), 4 * k)]) for k in range(2)]
        )
        return [
            builder.addrspacecast(builder.bitcast(p, vty.as_pointer()), vty.as_pointer(_SHARED))
            for p in parts
        ]

    def _shared_ok(arr, i) -> bool:
        return (
            isinstance(arr, types.Array)
            and arr.ndim == 1
            and arr.dtype in (types.float16, types.float32)
            and isinstance(i, types.Integer)
        )

    @intrinsic
    def _lds8(typingctx, arr, i):
        """arr[i : i + 8] of a 1-D shared array as 8 float32 (i a multiple of 8; the array
        16-byte aligned)."""
        if not _shared_ok(arr, i):
            return None
        sig = types.UniTuple(types.float32, VEC)(arr, i)

        def codegen(context, builder, signature, args):
            arr_ty, i_ty = signature.args
            half = arr_ty.dtype == types.float16
            vals = []
            for p in _shared_ptrs(context, builder, arr_ty, args[0], i_ty, args[1]):
                raw = builder.load(p, align=16)
                if half:
                    h8 = builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8))
                    for j in range(8):
                        h = builder.extract_element(h8, ir.Constant(ir.IntType(32), j))
                        vals.append(builder.fpext(h, ir.FloatType()))
                else:
                    vals += [
                        builder.extract_element(raw, ir.Constant(ir.IntType(32), j))
                        for j in range(4)
                    ]
            return context.make_tuple(builder, signature.return_type, vals)

        return sig, codegen

    @intrinsic
    def _sts8(typingctx, arr, i, vals):
        """arr[i : i + 8] = vals (8 float32, each rounded to arr's dtype: round to nearest
        even, as a scalar store would)."""
        ok = isinstance(vals, types.BaseTuple) and len(vals) == VEC
        if not (_shared_ok(arr, i) and ok and all(t == types.float32 for t in vals)):
            return None
        sig = types.void(arr, i, vals)

        def codegen(context, builder, signature, args):
            arr_ty, i_ty, _ = signature.args
            half = arr_ty.dtype == types.float16
            xs = [builder.extract_value(args[2], j) for j in range(VEC)]
            i32 = ir.IntType(32)
            ptrs = _shared_ptrs(context, builder, arr_ty, args[0], i_ty, args[1])
            if half:
                hv = ir.Constant(ir.VectorType(ir.HalfType(), 8), ir.Undefined)
                for j, v in enumerate(xs):
                    hv = builder.insert_element(
                        hv, builder.fptrunc(v, ir.HalfType()), ir.Constant(i32, j)
                    )
                builder.store(builder.bitcast(hv, ir.VectorType(i32, 4)), ptrs[0], align=16)
            else:
                for k, p in enumerate(ptrs):
                    fv = ir.Constant(ir.VectorType(ir.FloatType(), 4), ir.Undefined)
                    for j in range(4):
                        fv = builder.insert_element(fv, xs[4 * k + j], ir.Constant(i32, j))
                    builder.store(fv, p, align=16)
            return context.get_dummy_value()

        return sig, codegen


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


PRENORM_VARIANTS = (1, 2)  # the M values with a pre-norm kernel (batch-1/2 decode)


def _rows(kind: str, R: int, prenorm: bool) -> list[str]:
    """The warp's weight rows rw0.. and, without a prologue, the early exit of warps past the
    last row. With one (prenorm), every warp must reach the prologue's barriers, so those warps
    get `live = False` and clamped (readable, never written) rows, and leave after it."""
    exit_ = "        return  # the whole warp leaves together: the shuffles stay full-mask"
    if kind == GATE_UP:
        L = ["    N = w.shape[0] >> 1  # outputs: one per gate/up row pair", "    row0 = warp"]
        if prenorm:
            return L + ["    live = row0 < N", "    rw0 = min(row0, N - 1)", "    rw1 = rw0 + N"]
        return L + ["    if row0 >= N:", exit_, "    rw0 = row0", "    rw1 = row0 + N"]
    if kind == QKV_ROPE:
        L = ["    D = k_cache.shape[3]", "    half = D >> 1"]
        if prenorm:
            L += [
                "    pairs = w.shape[0] >> 1",
                "    live = warp < pairs",
                "    pw = min(warp, pairs - 1)",
                "    head = pw // half",
                "    j = pw - head * half",
            ]
        else:
            L += [
                "    if warp >= w.shape[0] >> 1:",
                exit_,
                "    head = warp // half",
                "    j = warp - head * half",
            ]
        return L + ["    rw0 = head * D + j", "    rw1 = rw0 + half"]
    L = ["    N = w.shape[0]", f"    row0 = warp * {R}"]
    L += ["    live = row0 < N"] if prenorm else ["    if row0 >= N:", exit_]
    # A partial last group of rows re-reads row N-1 (never written): no guard in the loop.
    return L + [f"    rw{r} = min(row0 + {r}, N - 1)" for r in range(R)]


def _prologue(M: int) -> list[str]:
    """residual_out <- residual + x (block 0), xs <- rms_norm(residual + x) * norm_w for the M
    rows, in shared memory, by every thread of the block. Rounding as fused_add_rms_norm's
    kernels (rmsnorm.py's _add8, _inv_rms and _scale8): h in the storage dtype, sum(h^2) and
    1/rms in fp32, h * (1/rms) rounded, times the weight, rounded by the store."""
    align = "" if SIM else ", alignment=16"  # ld/st.shared.v4; the simulator takes no alignment
    ks = [f"xk{m} + " if m else "" for m in range(M)]  # offsets of the shared rows
    L = [
        "    # Pre-norm prologue (see the module doc); every thread, before any warp leaves.",
        f"    xs = cuda.shared.array(0, x.dtype{align})  # [M * K], the launch's dynamic smem",
        "    scratch = cuda.shared.array(32, float32)",
        f"    stride = cuda.blockDim.x * {LANE_ELEMS}",
        "    keep = cuda.blockIdx.x == 0  # the one block that stores h",
    ]
    L += [f"    xk{m} = {m} * K" for m in range(1, M)]
    L += [f"    ss{m} = float32(0.0)" for m in range(M)]
    # Pass 1: h = residual + x chunk by chunk, into xs and (block 0) residual_out; sum(h^2).
    # Each thread re-reads only its own chunks in pass 2: no barrier between the passes.
    L += [f"    pc = cuda.threadIdx.x * {LANE_ELEMS}", "    while pc < K:"]
    for m in range(M):
        xm = f"xm{m}" if m else "0"
        L.append(f"        h{m} = _add8(ld8(residual, ({xm}, pc)), ld8(x, ({xm}, pc)), residual)")
    for m in range(M):
        L += [f"        _sts8(xs, {ks[m]}pc, h{m})", f"        ss{m} = dot8(ss{m}, h{m}, h{m})"]
    L.append("        if keep:")
    for m in range(M):
        ind = "            "
        if m:  # a missing row (Mx < M) has no residual_out row
            L.append(f"            if {m} < Mx:")
            ind += "    "
        L.append(f"{ind}st8(residual_out, ({m}, pc), h{m})")
    L.append("        pc += stride")
    L += [f"    inv{m} = _inv_rms(ss{m}, scratch, K, eps)" for m in range(M)]
    # Pass 2: each thread scales the chunks it wrote (one norm-weight load serves the M rows).
    L += [
        f"    pd = cuda.threadIdx.x * {LANE_ELEMS}",
        "    while pd < K:",
        "        nw = ld8(norm_w, (pd,))",
    ]
    L += [
        f"        _sts8(xs, {ks[m]}pd, _scale8(_lds8(xs, {ks[m]}pd), nw, inv{m}, x))"
        for m in range(M)
    ]
    L += ["        pd += stride", "    cuda.syncthreads()  # xs complete for every warp"]
    return L


def _source(M: int, R: int, U: int, kind: str = PLAIN, prenorm: bool = False) -> str:
    """The kernel for one (M, R, U), written out statement by statement.

    Generated rather than written with `for` loops over M, R and U: LLVM unrolls such loops only
    below its size threshold, and a loop it keeps turns the accumulators and the in-flight loads
    into local-memory arrays (and serialises the loads). Written out, every one is a register.

    gate_up: w is [2I, K], out [M, I]; the warp's two rows are j and I + j, and lane m writes
    h[m, j] = silu(gate) * up from the two sums.
    qkv_rope: w is the fused qkv weight, out [M, N]; the warp's two rows are dims j and j + D/2
    of one head (a NeoX rotary pair), and lane m rotates q and k rows at positions[m] and writes
    them, and v, to out and (k, v) to the paged cache at slot_mapping[m] (gemv_qkv_rope.py).
    prenorm (M in PRENORM_VARIANTS): four more arguments (residual, norm_w, eps, residual_out)
    and the prologue of `_prologue`; the first step's weight loads go before it, and the x
    chunks come from shared memory."""
    if kind not in KINDS:
        raise ValueError(f"gemv kind {kind!r} is not one of {KINDS}")
    if prenorm and M not in PRENORM_VARIANTS:
        raise ValueError(f"pre-norm gemv kernels exist for M in {PRENORM_VARIANTS}, not {M}")
    rope = kind == QKV_ROPE
    args = "x, w, bias, out, has_bias"
    if rope:
        args += ", positions, cos_sin, k_cache, v_cache, slots, n_q, n_kv"
    if prenorm:
        args += ", residual, norm_w, eps, residual_out"
    step = U * WARP_ELEMS
    acc = [f"a{m}_{r}" for m in range(M) for r in range(R)]
    L = [
        f"def kernel({args}):",
        "    lane = cuda.threadIdx.x & 31",
        "    warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> 5",
        "    K = w.shape[1]",
    ]
    L += _rows(kind, R, prenorm)
    # Fewer inputs than the variant's M: the missing rows re-read the last one (L1 hits) and
    # their outputs are not written.
    L.append("    Mx = x.shape[0]")
    L += [f"    xm{m} = min({m}, Mx - 1)" for m in range(1, M)]
    L += [f"    {a} = float32(0.0)" for a in acc]
    L += [f"    lc = lane * {LANE_ELEMS}", "    k0 = 0"]

    def loads(indent: str, g: str, guarded: bool, clamped: bool = False) -> list[str]:
        # g: the step's name suffix ("" full steps, "t" the tail, "f" the pre-norm first step).
        # clamped: chunks past K re-read the row's last chunk instead of being zeroed (their x
        # chunk is ZERO8, so they add nothing): the raw 16-byte loads then stay unconverted in
        # registers until their use (a zeroing select converts them up front: 96 vs 72 regs at M = 1, sm_70).
        out = [f"{indent}c{g}{j} = k0 + lc + {j * WARP_ELEMS}" for j in range(U)]
        # Every weight load of the step before the first use: R * U * 16 bytes in flight.
        for r in range(R):
            for j in range(U):
                if clamped:
                    out.append(f"{indent}w{g}{r}_{j} = ld8(w, (rw{r}, min(c{g}{j}, K - 8)))")
                elif guarded:
                    # Guards written out, not an inlined helper (see vec_io.dot8).
                    out.append(
                        f"{indent}w{g}{r}_{j} = ld8(w, (rw{r}, c{g}{j})) if c{g}{j} < K else ZERO8"
                    )
                else:
                    out.append(f"{indent}w{g}{r}_{j} = ld8(w, (rw{r}, c{g}{j}))")
        return out

    def dots(indent: str, g: str, guarded: bool) -> list[str]:
        # Then x chunk by chunk (L1/L2 hits, or shared memory), each used for all R rows.
        out = []
        for j in range(U):
            for m in range(M):
                if prenorm:
                    src = f"_lds8(xs, {f'xk{m} + ' if m else ''}c{g}{j})"
                else:
                    src = f"ld8(x, ({f'xm{m}' if m else '0'}, c{g}{j}))"
                # A name per (chunk, row): numba rebuilds SSA form over the whole kernel for
                # every name assigned more than once (compile time only; the PTX is the same).
                xv = f"xv{g}{j}_{m}"
                if guarded:
                    out.append(f"{indent}{xv} = {src} if c{g}{j} < K else ZERO8")
                else:
                    out.append(f"{indent}{xv} = {src}")
                for r in range(R):
                    out.append(f"{indent}a{m}_{r} = dot8(a{m}_{r}, {xv}, w{g}{r}_{j})")
        return out

    if prenorm:
        # The first step's weight loads, then the prologue while they are in flight.
        L += loads("    ", "f", True, clamped=True)
        L += _prologue(M)
        L += [
            "    if not live:",
            "        return  # the whole warp, now that the prologue's barriers are behind it",
        ]
        L += dots("    ", "f", True)
        L.append(f"    k0 = {step}")
    L.append(f"    while k0 + {step} <= K:")
    L += loads("        ", "", False) + dots("        ", "", False)
    L.append(f"        k0 += {step}")
    L.append("    if k0 < K:")
    L += loads("        ", "t", True) + dots("        ", "t", True)
    L += _epilogue(M, R, kind)
    return "\n".join(L) + "\n"


def _epilogue(M: int, R: int, kind: str) -> list[str]:
    """The warp sums and the outputs of the kind."""
    L = []
    if kind != PLAIN:
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
        if kind == GATE_UP:
            return L + [
                "        # As the linear stores gate and up, then as silu_and_mul rounds h.",
                "        out[lane, row0] = _silu_mul(round_like(a, out), round_like(b, out), out)",
            ]
        return L + [
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
    # Butterfly sums: every lane ends with every total; lane i writes output i = m * R + r.
    L.append("    mine = float32(0.0)")
    for i in range(M * R):
        L.append(f"    t = _warp_sum(a{i // R}_{i % R})")
        L.append(f"    if lane == {i}:")
        L.append("        mine = t")
    return L + [
        f"    if lane < {M * R}:",
        f"        row = row0 + lane % {R}",
        f"        if row < N and lane // {R} < Mx:",
        "            if has_bias:",
        "                mine += float32(bias[row])",
        f"            out[lane // {R}, row] = mine",
    ]


@cached_factory
def _build(M: int, R: int, U: int, kind: str = PLAIN, prenorm: bool = False):
    scope = {
        "cuda": cuda,
        "float32": float32,
        "ld8": ld8,
        "st8": st8,
        "ZERO8": ZERO8,
        "dot8": dot8,
        "_warp_sum": _warp_sum,
        "_silu_mul": _silu_mul,
        "round_like": round_like,
        "_rot1": _rot1,
        "_lds8": _lds8,
        "_sts8": _sts8,
        "_add8": _add8,
        "_inv_rms": _inv_rms,
        "_scale8": _scale8,
    }
    tag = "_prenorm" if prenorm else ""
    name = f"<gemv {kind}{tag} M={M} R={R} U={U}>"
    code = compile(_source(M, R, U, kind, prenorm), name, "exec")
    exec(code, scope)  # noqa: S102 - our own generated source, see _source
    return cuda.jit(named_kernel(scope["kernel"], __name__, f"gemv_{kind}{tag}_m{M}_r{R}_u{U}"))


_KERNELS: dict[tuple[int, str, bool], object] = {}  # (variant M, kind, prenorm)


VARIANTS = (1, 2, 4, 8)  # compiled M values; other M use the next larger one


def variant_for(m: int) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv kernels cover M = 1..{MAX_M}, got {m}")
    return next(v for v in VARIANTS if v >= m)


def gemv_kernel(m: int, kind: str = PLAIN, prenorm: bool = False):
    """The kernel of `kind` that serves M = m inputs (the M = variant_for(m) kernel, built
    once): plain, gate_up (w a merged gate_up weight, out the activation) or qkv_rope; with
    the pre-norm prologue when prenorm (M = 1, 2 only)."""
    v = variant_for(m)
    key = (v, kind, prenorm)
    k = _KERNELS.get(key)
    if k is None:
        # prenorm is passed only when set: the other kernels keep their compile-cache keys.
        extra = (True,) if prenorm else ()
        k = _KERNELS[key] = _build(v, *tile_for(v, kind), kind, *extra)
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
# The pre-norm variants (not in the registry yet: the CPU compile check's time budget). Their
# signatures: the kind's, then residual [M, K], norm_w [K], eps float32, residual_out [M, K].
gemv_prenorm_kernel_m1 = gemv_kernel(1, PLAIN, True)
gemv_prenorm_kernel_m2 = gemv_kernel(2, PLAIN, True)
gemv_gate_up_prenorm_kernel_m1 = gemv_kernel(1, GATE_UP, True)
gemv_gate_up_prenorm_kernel_m2 = gemv_kernel(2, GATE_UP, True)
gemv_qkv_rope_prenorm_kernel_m1 = gemv_kernel(1, QKV_ROPE, True)
gemv_qkv_rope_prenorm_kernel_m2 = gemv_kernel(2, QKV_ROPE, True)


def grid_for(m: int, n: int, kind: str = PLAIN, warps: int | None = None) -> int:
    """Blocks for n weight rows (plain) or n row pairs (gate_up: n = I; qkv_rope: N / 2), with
    `warps` warps per block (default WARPS)."""
    r, _ = tile_for(variant_for(m), kind)
    rows_per_block = (WARPS if warps is None else warps) * (r if kind == PLAIN else 1)
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


# Pre-norm kernels: dynamic shared memory for the normalised rows, within the 48 KiB a block may
# take without an opt-in attribute (cudaFuncSetAttribute: a host call per kernel and device,
# awkward before a graph capture), less the reduction's static 32-float scratch.
PRENORM_SMEM_MAX = 48 * 1024 - 32 * 4
# Warps per block of the pre-norm kernels (the kernels take any block size). Every block repeats
# the prologue's row reads, so wider blocks cut that traffic in proportion (and shorten the
# prologue: fewer chunks per thread), at fewer resident blocks per SM. WARPS until measured.
PRENORM_WARPS = WARPS


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte] of the memory a strided tensor covers."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a1 <= b0 or b1 <= a0


def supports_prenorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    residual_out: torch.Tensor,
    out: torch.Tensor | None = None,
) -> bool:
    """True when a pre-norm kernel can take this input (the kind's own `supports` check comes
    on top): CUDA tensors of x's dtype, M in PRENORM_VARIANTS, x, residual and residual_out
    [M, K] and norm_w [K] with 16-byte rows, M * K * itemsize <= PRENORM_SMEM_MAX (K <= 12256
    at M = 2 in fp16), and residual_out and out disjoint from the inputs (every block reads x
    and residual while block 0 writes residual_out and every block its outputs). Otherwise the
    caller runs the unfused ops (the launchers here: the reference)."""
    if not (x.is_cuda and x.dim() == 2 and x.shape[0] in PRENORM_VARIANTS):
        return False
    M, K = x.shape
    rows = (residual, residual_out)
    written = (residual_out,) if out is None else (residual_out, out)
    return (
        all(t.is_cuda and t.dtype == x.dtype for t in (*rows, norm_w))
        and all(t.shape == x.shape for t in rows)
        and norm_w.shape == (K,)
        and vec_ok(x, residual, residual_out, norm_w)
        and M * K * x.element_size() <= PRENORM_SMEM_MAX
        and all(_disjoint(a, b) for a in written for b in (x, residual))
        and (out is None or _disjoint(out, residual_out))
    )


def _launch_smem(kernel, grid: int, block: int, args: tuple, stream, smem: int) -> None:
    """kernel[grid, block, stream, smem](*args): numba_common.launch with dynamic shared memory."""
    kernel[grid, block, stream, smem](*args)


def launch_gemv(
    x, w, bias, out, kind: str = PLAIN, extra: tuple = (), norm: tuple | None = None
) -> torch.Tensor:
    """One launch of the `kind` kernel for inputs its caller checked. out: the output, or None
    for a new one ([M, outputs]); extra: the kind's arguments after has_bias (qkv_rope's,
    already converted); norm: (residual, norm_w, eps, residual_out) for the pre-norm kernel
    (checked with supports_prenorm). Every gemv launcher (here and gemv_qkv_rope.py) goes
    through it."""
    M, rows = x.shape[0], w.shape[0]
    if out is None:  # gate_up writes one activation per row pair; the others a column per row
        cols = rows // 2 if kind == GATE_UP else rows
        out = torch.empty((M, cols), dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    b = bias if has_bias else w[0]  # any 1-D array of the dtype; not read without a bias
    units = rows if kind == PLAIN else rows // 2
    args = (dev(x), dev(w), dev(b), dev(out), has_bias, *extra)
    if norm is None:
        launch(gemv_kernel(M, kind), grid_for(M, units, kind), THREADS, args, current_stream())
        return out
    residual, norm_w, eps, residual_out = norm
    # eps as float32: the kernel adds it in fp32, as rms_norm_ref and rmsnorm.py's kernels do.
    args += (dev(residual), dev(norm_w), np.float32(eps), dev(residual_out))
    smem = M * x.shape[1] * x.element_size()  # the M normalised rows (variant M == M here)
    grid = grid_for(M, units, kind, PRENORM_WARPS)
    kernel = gemv_kernel(M, kind, True)
    _launch_smem(kernel, grid, 32 * PRENORM_WARPS, args, current_stream(), smem)
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


def _run_prenorm(x, residual, norm_w, eps, w, bias, residual_out, out, kind, ok, ref):
    """Launch the pre-norm `kind` kernel when the kind's check (ok) and supports_prenorm accept
    the input, else run `ref` (same arguments, same effect)."""
    if ok and supports_prenorm(x, residual, norm_w, residual_out, out):
        return launch_gemv(x, w, bias, out, kind, norm=(residual, norm_w, eps, residual_out))
    return ref(x, residual, norm_w, eps, w, bias, residual_out=residual_out, out=out)


def gemv_prenorm_cuda(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual_out: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same meaning as gemv_prenorm_ref: one launch on torch's current stream, no host sync (a
    CUDA graph can capture it). What `supports` or `supports_prenorm` rejects runs the
    reference."""
    ok = supports(x, w)
    args = (x, residual, norm_w, eps, w, bias, residual_out, out)
    return _run_prenorm(*args, PLAIN, ok, gemv_prenorm_ref)


def gemv_gate_up_prenorm_cuda(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual_out: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same meaning as gemv_gate_up_prenorm_ref: one launch, no host sync. What
    `supports_gate_up` or `supports_prenorm` rejects runs the reference."""
    ok = supports_gate_up(x, w)
    args = (x, residual, norm_w, eps, w, bias, residual_out, out)
    return _run_prenorm(*args, GATE_UP, ok, gemv_gate_up_prenorm_ref)


gemv_prenorm_cuda_dtypes = gemv_cuda_dtypes
gemv_gate_up_prenorm_cuda_dtypes = gemv_cuda_dtypes


__all__ = [
    "gemv_ref",
    "gemv_gate_up_ref",
    "gemv_prenorm_ref",
    "gemv_gate_up_prenorm_ref",
    "gemv_cuda",
    "gemv_gate_up_cuda",
    "gemv_prenorm_cuda",
    "gemv_gate_up_prenorm_cuda",
    "gemv_kernel",
    "supports",
    "supports_gate_up",
    "supports_prenorm",
    "tile_for",
    "grid_for",
]
