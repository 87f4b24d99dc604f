"""Grouped MoE expert GEMMs on Volta tensor cores (fp16 experts; the default, VOLTSERVE_MOE_WMMA=0
leaves it), for batched decode and prefill. Same grouping and meaning as moe/grouped.py (the SIMT
kernels, fp32 and the comparison); the products run as wmma m16n16k16 (f16 in, f32
accumulate) through the inline-PTX device function vs_moe_tile16x64 of wmma_ptx.cu, linked as a
C function (cuda.declare_device(..., abi="c"); wmma_ptx.py's building block kernel is the
smallest such link).

- The pairs' rows of x are gathered into expert order first (x_sorted, one torch index_select:
  no host sync), so every A tile is 16 consecutive rows that wmma loads straight from global
  memory; x_sorted and h_sorted carry 16 rows of padding, so the last tile's rows past the end
  are readable (their outputs, like those of rows that belong to the next expert, are computed
  and dropped).
- One warp computes one 16 x 64 tile: gate_up takes 32 gate rows and the matching 32 up rows
  of its expert (output: 32 activations per row, silu rounded as silu_and_mul rounds it), down
  takes 64 rows of w2 (output: routing weight x product into the pair's row of y_pairs, fp32).
  4 warps per block cover 4 column groups of one tile.
- Shapes: intermediate a multiple of 32, hidden a multiple of 64 (every Qwen-MoE and Mixtral
  size is); anything else runs the SIMT kernels.

The reference is kernels/moe/experts.py's moe_experts_ref.
"""

from __future__ import annotations

from pathlib import Path

import torch
from numba import cuda, int32, int64
from voltserve.kernels.elementwise.activation import _silu_mul
from voltserve.kernels.moe.grouped import BM, _tile_of
from voltserve.kernels.moe.routing import moe_align_ref
from voltserve.kernels.runtime.compile_cache import cached
from voltserve.kernels.runtime.numba_common import SIM, current_stream, float32, launch, round_like

WMMA_CU = str(Path(__file__).parent.parent / "runtime" / "wmma_ptx.cu")
CUDA_SOURCES: tuple[str, ...] = (WMMA_CU,)
WARPS = 4
TILE_N = 64  # output columns of one warp's tile (gate_up: 32 gate + 32 up weight rows)
PAIRS = TILE_N // 2
STAGE = 16 * TILE_N  # f32 per warp: its 16 x 64 tile staged for the epilogue
STAGE_ALL = WARPS * STAGE  # the block's staging area (a plain global: a compile-time size)
assert BM == 16, "a tile of sorted rows is one wmma row block"

if not SIM:
    import cffi
    from numba import types

    ffi = cffi.FFI()
    _P16 = types.CPointer(types.float16)
    _P32 = types.CPointer(types.float32)
    _I32, _I64 = types.int32, types.int64
    moe_tile = cuda.declare_device(
        "vs_moe_tile16x64",
        types.int32(_P32, _I32, _P16, _I64, _I32, _P16, _I64, _I64, _I64, _I64, _I32, _I32),
        link=[WMMA_CU],
        abi="c",
    )

    @cached
    @cuda.jit
    def moe_wmma_gate_up_kernel(
        x_flat, w13_flat, expert_start, tile_first, tile_expert, h_sorted, hidden
    ):
        # x_flat: x_sorted [P + 16, H] flattened; w13_flat: [E, 2I, H] flattened;
        # h_sorted [P + 16, I]
        e, r0, r1 = _tile_of(cuda.blockIdx.x, tile_expert, tile_first, expert_start)
        if e < 0:
            return
        stage = cuda.shared.array(STAGE_ALL, float32, alignment=128)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        inter = h_sorted.shape[1]
        j0 = (cuda.blockIdx.y * WARPS + warp) * PAIRS
        if j0 >= inter:
            return  # the whole warp (only warp-level sync below)
        H = hidden
        g0 = (e * 2 * inter + j0) * H
        u0 = (e * 2 * inter + inter + j0) * H
        so = warp * STAGE
        moe_tile(
            ffi.from_buffer(stage),
            int32(so),
            ffi.from_buffer(x_flat),
            int64(r0 * H),
            int32(H),
            ffi.from_buffer(w13_flat),
            int64(g0),
            int64(g0 + 16 * H),
            int64(u0),
            int64(u0 + 16 * H),
            int32(H),
            int32(H),
        )
        cuda.syncwarp()
        for i in range(lane, 16 * PAIRS, 32):
            r = i // PAIRS
            c = i - r * PAIRS
            s = r0 + r
            if s < r1:
                g = stage[so + r * TILE_N + c]
                u = stage[so + r * TILE_N + PAIRS + c]
                h_sorted[s, j0 + c] = _silu_mul(
                    round_like(g, h_sorted), round_like(u, h_sorted), h_sorted
                )

    @cached
    @cuda.jit
    def moe_wmma_down_kernel(
        h_flat, w2_flat, order, expert_start, tile_first, tile_expert, wts_flat, y_pairs, inter
    ):
        # h_flat: h_sorted [P + 16, I] flattened; w2_flat: [E, H, I] flattened; y_pairs [P, H]
        e, r0, r1 = _tile_of(cuda.blockIdx.x, tile_expert, tile_first, expert_start)
        if e < 0:
            return
        stage = cuda.shared.array(STAGE_ALL, float32, alignment=128)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        H = y_pairs.shape[1]
        n0 = (cuda.blockIdx.y * WARPS + warp) * TILE_N
        if n0 >= H:
            return
        b0 = (e * H + n0) * inter
        so = warp * STAGE
        moe_tile(
            ffi.from_buffer(stage),
            int32(so),
            ffi.from_buffer(h_flat),
            int64(r0 * inter),
            int32(inter),
            ffi.from_buffer(w2_flat),
            int64(b0),
            int64(b0 + 16 * inter),
            int64(b0 + 32 * inter),
            int64(b0 + 48 * inter),
            int32(inter),
            int32(inter),
        )
        cuda.syncwarp()
        for i in range(lane, 16 * TILE_N, 32):
            r = i // TILE_N
            c = i - r * TILE_N
            s = r0 + r
            if s < r1:
                p = order[s]
                y_pairs[p, n0 + c] = wts_flat[p] * stage[so + i]


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """fp16 and the tile multiples (the caller checked the rest: moe_experts.supports)."""
    return (
        not SIM
        and x.dtype == torch.float16
        and w2.shape[2] % PAIRS == 0
        and x.shape[1] % TILE_N == 0
    )


def moe_wmma(
    x: torch.Tensor,  # [T, H] fp16
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32, contiguous
    topk_ids: torch.Tensor,  # [T, k] int32, contiguous
) -> torch.Tensor:
    T, H = x.shape
    k = topk_ids.shape[1]
    E, inter = w2.shape[0], w2.shape[2]
    P = T * k
    order, expert_start, tile_first, tile_expert = moe_align_ref(topk_ids, E, BM)
    tiles = tile_expert.shape[0]
    x_sorted = torch.empty((P + BM, H), dtype=x.dtype, device=x.device)
    torch.index_select(x, 0, order.long() // k, out=x_sorted[:P])
    h_sorted = torch.empty((P + BM, inter), dtype=x.dtype, device=x.device)
    y_pairs = torch.empty((P, H), dtype=torch.float32, device=x.device)
    stream = current_stream()
    meta = (expert_start, tile_first, tile_expert)
    launch(
        moe_wmma_gate_up_kernel,
        (tiles, -(-inter // (PAIRS * WARPS))),
        32 * WARPS,
        (x_sorted.view(-1), w13.view(-1), *meta, h_sorted, H),
        stream,
    )
    launch(
        moe_wmma_down_kernel,
        (tiles, -(-H // (TILE_N * WARPS))),
        32 * WARPS,
        (
            h_sorted.view(-1),
            w2.view(-1),
            order,
            *meta,
            topk_weights.reshape(-1),
            y_pairs,
            inter,
        ),
        stream,
    )
    return y_pairs.view(T, k, H).sum(dim=1).to(x.dtype)


__all__ = ["moe_wmma", "supports", "CUDA_SOURCES"]
