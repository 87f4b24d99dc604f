"""Fused MoE experts with FP4 weights (NVFP4: E2M1 codes, an E4M3 scale per 16 inputs and an
fp32 global scale per row; MXFP4: E2M1 codes, an E8M0 scale per 32 inputs) for decode batches,
on the cc 7.0 feature set (fp16 storage, fp32 arithmetic): per token only its k experts' codes
and scale bytes are read and decoded in registers, in two launches and no host synchronisation.

The experts are quant/fp4_experts.py's stacked packed tensors seen as one flat Fp4Weight per
projection (kernels/linear/fp4_pack.py): w13 rows e * 2I + j (expert e's gate rows, then its up
rows), w2 rows e * H + n. Each launch is the decode step of the dense FP4 GEMV's
one-row-a-warp form (fp4_kernels.fp4_gemv_v1_kernel; fp4_kernels.decode_chunk / dot_chunk: a
lane takes 16 inputs, one block, per step, the E2M1 values from a 16-entry shared table, the 16
products summed in fp32 and multiplied once by the block's scale) pointed at the routed
expert's rows, in quant_decode.py's two launches:

1. gate_up: h[p, j] = silu(x[t] . w13[e, j]) * (x[t] . w13[e, I + j]) for every pair
   p = t * k + slot, e = topk_ids[t, slot]; one warp owns column j of one pair (its gate and up
   rows, so both sums end in the same warp), rounded as the linear and the activation round
   (gate and up to the storage dtype, silu, then the product).
2. down + weighted sum: out[t, n] = sum_slot w[t, slot] * (h[t * k + slot] . w2[e_slot, n]);
   one warp owns row n of one token and walks its k experts, the routing weight folded into
   each row's global scale (one multiply per block, not per weight), so the weighted sum
   accumulates in fp32 in the same registers and the output is rounded once. No atomics, no
   [T, k, H] intermediate.

Geometry (launch_geometry): blocks of `WARPS` warps over the columns (gate_up: I;
down: H) on x, the pairs (gate_up) or tokens (down) folded over y and z (fold_yz); a warp past
the columns computes the last one and writes nothing, so every lane reaches the same shuffles.
When the fused launches serve is quant_decode.fused_pays, the integer experts' rule: the
dequantizing path reads the FP4 bytes of all E experts and writes and reads back fp16 weights,
(4.5 + 16 + 16) / 4.5 ~ 8x their bytes, the same ratio PAIRS_PER_EXPERT stands for.

The reference (`moe_fp4_experts_ref`) is moe_experts_ref on the dequantized stacked weights
(fp4_pack.dequantize_fp4 rounded to the run dtype); the kernels decode in fp32 and round only
their outputs.
"""

from __future__ import annotations

import torch
from numba import cuda
from voltserve.kernels.elementwise.activation import _silu_mul
from voltserve.kernels.linear import fp4_kernels
from voltserve.kernels.linear.fp4_kernels import CHUNK, decode_chunk, dot_chunk, fill_table
from voltserve.kernels.linear.fp4_linear import code_words
from voltserve.kernels.linear.fp4_pack import Fp4Weight, dequantize_fp4
from voltserve.kernels.linear.gemv import _warp_sum
from voltserve.kernels.moe.quant_decode import dequantized_experts_ref, fused_pays, launch_inputs
from voltserve.kernels.runtime.launch_geometry import fold_yz, on_gpu
from voltserve.kernels.runtime.numba_common import SIM, current_stream, float32, launch, round_like

# Warps per block: the dense FP4 GEMV's 4. In the simulator one: its shuffles are barriers over
# the whole block, and a one-warp block makes them about 3x cheaper (the kernels are the same).
WARPS = 1 if SIM else fp4_kernels.WARPS
THREADS = 32 * WARPS
DTYPES = (torch.float16, torch.float32)


@cuda.jit(device=True, inline="always")
def _lane_dot(tab, packed, scales, r, g, x, m, gshift, e8m0):
    """This lane's share of x[m] . (weight row r times g): 16 inputs per step, 512 per warp."""
    acc = float32(0.0)
    for k in range(CHUNK * (cuda.threadIdx.x & 31), x.shape[1], 32 * CHUNK):
        w, s = decode_chunk(tab, packed, scales, r, k, gshift, e8m0, g)
        acc += dot_chunk(w, x, m, k) * s
    return acc


def fp4_moe_gate_up_kernel(x, packed, scales, gscale, ids, out, gshift, e8m0):
    tab = cuda.shared.array(16, float32)
    fill_table(tab)
    p = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y  # launch_geometry.fold_yz
    if p >= out.shape[0]:
        return  # the whole block leaves together
    N = out.shape[1]  # I: gate rows base + j, up rows base + N + j
    col = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
    live = col < N
    c = col if live else N - 1
    k = ids.shape[1]
    t = p // k
    rg = ids[t, p - t * k] * (2 * N) + c
    ru = rg + N
    a = _warp_sum(_lane_dot(tab, packed, scales, rg, gscale[rg], x, t, gshift, e8m0))
    b = _warp_sum(_lane_dot(tab, packed, scales, ru, gscale[ru], x, t, gshift, e8m0))
    if (cuda.threadIdx.x & 31) == 0 and live:
        # as the linear stores gate and up, then as silu_and_mul rounds h
        out[p, c] = _silu_mul(round_like(a, out), round_like(b, out), out)


def fp4_moe_down_kernel(h, packed, scales, gscale, ids, wts, out, gshift, e8m0):
    tab = cuda.shared.array(16, float32)
    fill_table(tab)
    tok = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y  # launch_geometry.fold_yz
    if tok >= out.shape[0]:
        return  # the whole block leaves together
    N = out.shape[1]  # H
    row = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
    live = row < N
    c = row if live else N - 1
    k = ids.shape[1]
    acc = float32(0.0)
    for s in range(k):
        r = ids[tok, s] * N + c
        g = gscale[r] * wts[tok, s]  # the routing weight folded into the row's global scale
        acc += _lane_dot(tab, packed, scales, r, g, h, tok * k + s, gshift, e8m0)
    acc = _warp_sum(acc)
    if (cuda.threadIdx.x & 31) == 0 and live:
        out[tok, c] = acc


fp4_moe_gate_up_kernel = cuda.jit(fp4_moe_gate_up_kernel)
fp4_moe_down_kernel = cuda.jit(fp4_moe_down_kernel)


def grid(columns: int, programs: int, limit: int | None = None) -> tuple[int, int, int]:
    """(blocks over `columns` (gate_up: I, down: H), programs (pairs / tokens) folded over y and
    z). `limit`: fold_yz's, for simulator tests that fold at small shapes."""
    yz = fold_yz(programs) if limit is None else fold_yz(programs, limit)
    return (-(-columns // WARPS), *yz)


# ---------------------------------------------------------------------------------------------
# Host side


def flat_experts(packed, scales, gscale, group_size: int, scale_kind: str) -> Fp4Weight:
    """Stacked [E, N, ...] FP4 tensors (quant/fp4_experts.py) as one [E * N, K] weight (views)."""
    E, N = packed.shape[0], packed.shape[1]
    return Fp4Weight(
        packed.reshape(E * N, -1),
        scales.reshape(E * N, -1),
        gscale.reshape(E * N),
        group_size,
        scale_kind,
    )


def moe_fp4_experts_ref(
    x: torch.Tensor,  # [T, H]
    w13: Fp4Weight,  # flat [E * 2I, H]
    w2: Fp4Weight,  # flat [E * H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """moe_experts_ref on the dequantized experts (the meaning the kernels are tested to)."""
    return dequantized_experts_ref(x, w13, w2, topk_weights, topk_ids, dequantize_fp4)


def _weight_ok(w: Fp4Weight) -> bool:
    return (
        on_gpu(w.packed)
        and w.packed.is_contiguous()
        and w.scales.is_contiguous()
        and w.gscale.is_contiguous()
        and w.packed.data_ptr() % 4 == 0  # read as int32 code words
        and w.in_features % CHUNK == 0
    )


def supports(x: torch.Tensor, w13: Fp4Weight, w2: Fp4Weight, k: int) -> bool:
    """True when the fused kernels cover this step (else the caller dequantizes)."""
    if not (on_gpu(x) and x.dim() == 2 and x.dtype in DTYPES and k >= 1):
        return False
    H, inter = x.shape[1], w2.in_features
    if w13.in_features != H or w2.out_features % H:
        return False
    E = w2.out_features // H
    return (
        w13.out_features == 2 * inter * E
        and fused_pays(x.shape[0], k, E)
        and _weight_ok(w13)
        and _weight_ok(w2)
    )


def moe_fp4_decode(
    x: torch.Tensor,  # [T, H]
    w13: Fp4Weight,  # flat [E * 2I, H]
    w2: Fp4Weight,  # flat [E * H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """The two launches on torch's current stream, for inputs `supports` accepted: [T, H]."""
    inter = w2.in_features
    x, wts, ids, h = launch_inputs(x, topk_weights, topk_ids, inter)
    T, H = x.shape
    k = topk_ids.shape[1]
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    stream = current_stream()
    launch(
        fp4_moe_gate_up_kernel,
        grid(inter, T * k),
        THREADS,
        (x, code_words(w13), w13.scales, w13.gscale, ids, h, w13.group_shift, w13.e8m0),
        stream,
    )
    launch(
        fp4_moe_down_kernel,
        grid(H, T),
        THREADS,
        (h, code_words(w2), w2.scales, w2.gscale, ids, wts, out, w2.group_shift, w2.e8m0),
        stream,
    )
    return out


__all__ = [
    "flat_experts",
    "fp4_moe_down_kernel",
    "fp4_moe_gate_up_kernel",
    "grid",
    "moe_fp4_decode",
    "moe_fp4_experts_ref",
    "supports",
]
