"""Flash-attention paged prefill for Volta (SM70) and newer: the whole key-tile loop of a thread
block in one linked CUDA C++ function (attention/prefill_fa.cu), so the output accumulators stay
in registers from the first key to the last. The numba kernel here only hands it pointers. The
engine's prefill attention wherever it covers the shape (`paged_attention_cuda`: head dims 64,
128 and 256, up to 64 query heads per KV head); the CUDA-core kernel of attention/prefill.py
serves the rest.

Meaning: `paged_attention_ref` in attention/ref.py (flat batch of query tokens from several
sequences, paged KV cache [num_blocks, num_kv_heads, 16, head_dim], causal with query i of a
sequence at position seq_len - q_len + i, query head h reads KV head h // group). fp16 in and
out, fp32 softmax and accumulation.

Why one C++ function runs the whole key loop: calling a small C function once per 32-key tile
leaves the output accumulator a per-thread array in local memory (read and written every tile:
512 bytes a lane at head dim 128) and costs four block barriers a tile. Here the accumulators,
the warp's query fragments and the softmax state never leave registers. Figures against SDPA:
BENCHMARKS.md §5 (head dims 64 and 128) and §19 (256).

Layout (per thread block: one sequence, one KV head, 64 rows in 4 row tiles of 16, a row being a
(query token, query head of that KV head) pair, so each K/V tile is read once for the group):
  * head dims 64 and 128: 4 warps, one a row tile; its Q rows are loaded once as D/16 wmma A
    fragments (registers), and it accumulates O[16, D];
  * head dim 256: 8 warps, two a row tile, each owning half of the head dim: its 8 Q fragments
    and 8 O accumulators (a head-dim-128 warp's 64 + 64 registers). Each computes a partial S
    over its half of the dims (Q[:, half] K[:, half]^T) into its own scratch; the pair meets at
    a named barrier (`bar.sync 1 + tile, 64`), and both warps add the two partials in the same
    order, so both hold bitwise the same S and run the same softmax (the same m, l, P and the
    same rescale and skip decisions, so the pair reaches its barriers together); each then
    accumulates O over its half of V's columns. Why this split: one warp with all 256 columns
    needs 128 + 128 registers of Q and O before any score (ptxas's limit is 255); re-reading Q
    from shared memory each tile needs its 33 KB there beside the K/V tiles (over 48 KB);
    splitting a tile's keys between two warps still leaves each 128 accumulator registers.
    Splitting the dims halves both, at the price of a 1 KB partial through shared memory, a
    pair barrier a tile and a softmax done twice (8 scores a lane);
  * keys go in tiles of N = 32 (two cache blocks; 16 at head dim 256, to fit shared memory).
    K and V tiles are double-buffered in shared memory and filled through registers: each
    thread loads its 16-byte chunks of tile t + 1's K before tile t's scores and stores them
    after, then the same for V around the softmax and P V (Volta has no cp.async). The
    block-table entries are read a tile earlier still. One block barrier per tile, at its end;
  * per warp and tile: S[16, N] = Q K^T (N/16 accumulators) stored to the warp's own f32
    scratch; two lanes per row read N/2 scores each, mask (only on the diagonal tile), take the
    row max (one shuffle), and write P as f16 (over the scores, or at 256 beside them: the
    partner may still be reading them); O[16, D/SPLIT] += P V;
  * lazy rescaling: a row's reference max m moves only when the tile's max exceeds it by more
    than 8 (log2 units). O and l share m, so this is exact, and p = 2^(s - m) <= 256 stays well
    inside f16 and f32. Rescaling needs each accumulator register's row, which wmma keeps opaque
    (and which differs between sm_70 and sm_80+): the per-row factor is written as a 16 x 16 f32
    tile (element (r, c) = alpha[r]) and read back with wmma.load.c, the accumulator layout. A
    warp rescales only when one of its rows moved (a vote), so after the first tile almost never
    (at 256 the alpha tile overwrites the warp's S partial, after a second pair barrier that only
    a rescale takes);
  * row tiles skip key tiles wholly past their rows' positions (causal; a function of the row
    tile, so both warps of a pair skip together), and grid rows run in reverse so the query
    tiles with the longest context start first;
  * epilogue: O / l (the same row-tile trick), staged through the warp's scratch as f32, written
    as 16-byte f16 stores.

Shared memory (static, under Volta's 48 KB): 4 K/V tiles of N x (D + 8) f16 + a scratch of
16 x LDS f32 per warp. D = 128: 4 x 32 x 136 x 2 = 34,816 + 4 x 16 x 36 x 4 = 9,216, 44,032
bytes; 64: 18,432 + 9,216 = 27,648; 256: 4 x 16 x 264 x 2 = 33,792 + 8 x 16 x 28 x 4 = 14,336,
48,128 bytes (1 KB under the limit; a scratch row holds S in 64 bytes, P in 32 and 16 of padding,
and the alpha tile overlays S). Q is staged through the second K/V buffer pair before the loop
(at 256 through all four, 64 x 264 f16 = 33,792 bytes, with tile 0 held in registers until
every warp has its Q fragments). Rows are padded (D + 8 f16, 36 f32) so wmma loads and the row
reads fall in distinct banks; at 256 the scratch rows are 28 f32, the most the 48 KB leaves
(the score reads meet 2-way bank conflicts there).

Registers (ptxas, sm_70, the function inlined into a kernel with its launch bounds as numba's
link-time optimisation does; tests/kernels/test_prefill_fa_compile.py): 242 at head dim 128
(qf 64 + O 64 + S, P, K/V staging), 2 blocks of 128 threads per SM; 161 at 64, 3 blocks; 226 at
256 (qf 64 + O 64 as at 128, with half the S, scores and staging), 1 block of 256 threads per SM
(two would need 128 registers a thread; shared memory would allow two), so 8 warps an SM as at
128. No spills. ptxas reports 16 barriers at 256 (a named barrier's id is a register there),
moot at one block an SM. numba-cuda links with LTO whenever nvJitLink is present, and the kernel
here asks for it (lto=True). `voltserve check-kernels` links the PTX without LTO, where each C
function is a real ABI call: its callee-saved registers are saved to the stack on entry (once
per block) and show there as "spill" (156, 492 and 416 bytes for the 64, 128 and 256 entry
points, summed over the module in its report); that build is what the check compiles, not what
runs.

The CUDA simulator cannot run linked C++: under NUMBA_ENABLE_CUDASIM this module imports but its
launcher raises.
"""

from __future__ import annotations

import functools
from pathlib import Path

from numba import cuda, float32, int32
from voltserve.kernels.attention.common import check_paged_cache
from voltserve.kernels.runtime.compile_cache import cached_factory
from voltserve.kernels.runtime.numba_common import SIM, current_stream, launch

FA_CU = str(Path(__file__).with_name("prefill_fa.cu"))
# CUDA C++ files the kernels of this module link; `voltserve check-kernels` compiles them too.
CUDA_SOURCES: tuple[str, ...] = (FA_CU,)

BLOCK_SIZE = 16  # tokens per KV cache block
ROWS = 64  # (token, head) rows per thread block, in row tiles of 16: ROWS in the .cu
HEAD_DIMS = (64, 128, 256)
# Warps sharing a row tile, each owning head_dim / SPLIT of its columns: SPLIT in the .cu.
SPLIT = {64: 1, 128: 1, 256: 2}
KV_TILE = {64: 32, 128: 32, 256: 16}  # keys per tile: N in the .cu
# Blocks per SM the launch bounds ask ptxas to leave room for (registers; shared memory allows
# 2 at head dim 128 and 256 and 3 at 64 on Volta's 96 KB, but at 256 two blocks of 256 threads
# would need 128 registers a thread).
MIN_BLOCKS = {64: 3, 128: 2, 256: 1}


def num_threads(head_dim: int) -> int:
    """Threads per block: 4 row tiles of SPLIT warps (vsfa::Shape<D>::THREADS)."""
    return 32 * 4 * SPLIT[head_dim]


def smem_bytes(head_dim: int) -> int:
    """vsfa::Shape<D>::SMEM_BYTES: 4 K/V tiles of N x (D + 8) f16 + each warp's scratch of
    16 x LDS f32 (LDS = N + 4 at one warp a row tile, 28 at two)."""
    n = KV_TILE[head_dim]
    lds = n + 4 if SPLIT[head_dim] == 1 else 28
    return 4 * n * (head_dim + 8) * 2 + 4 * SPLIT[head_dim] * 16 * lds * 4


def fa_group(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Query heads per KV head, after checking that this kernel covers the shape."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"flash prefill supports head_dim {HEAD_DIMS}, got {head_dim}")
    group = num_heads // num_kv_heads
    if group > ROWS:
        raise ValueError(f"group {group} (query heads per KV head) exceeds {ROWS}")
    return group


if not SIM:
    import cffi
    from numba import types

    ffi = cffi.FFI()
    _P16 = types.CPointer(types.float16)
    _PI32 = types.CPointer(types.int32)
    _P32 = types.CPointer(types.float32)
    _I32 = types.int32
    # (out, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, query_start_loc, scale,
    #  num_kv_heads, group, smem)
    _FA_ARGS = (_P16, _P16, _P16, _P16, _PI32, _I32, _PI32, _PI32, types.float32, _I32, _I32, _P32)
    fa_prefill = {
        d: cuda.declare_device(f"vs_fa_prefill_d{d}", types.int32(*_FA_ARGS), link=[FA_CU], abi="c")
        for d in HEAD_DIMS
    }


@cached_factory
@functools.cache
def prefill_fa_kernel(head_dim: int):
    """The kernel for one head dim (the group is an argument)."""
    if SIM:
        raise RuntimeError("the flash prefill kernel links CUDA C++: no CUDA simulator path")
    fn = fa_prefill[head_dim]
    SMEM_F32 = smem_bytes(head_dim) // 4

    def kernel(
        out,  # flat [T * H * D] fp16
        q,  # flat [T * H * D] fp16
        k_cache,  # flat [num_blocks * num_kv_heads * 16 * D] fp16
        v_cache,
        block_tables,  # [B, W] int32
        seq_lens,  # [B] int32
        query_start_loc,  # [B + 1] int32
        scale,
        num_kv_heads,
        group,
    ):
        smem = cuda.shared.array(SMEM_F32, float32, alignment=128)
        fn(
            ffi.from_buffer(out),
            ffi.from_buffer(q),
            ffi.from_buffer(k_cache),
            ffi.from_buffer(v_cache),
            ffi.from_buffer(block_tables),
            int32(block_tables.shape[1]),
            ffi.from_buffer(seq_lens),
            ffi.from_buffer(query_start_loc),
            float32(scale),
            int32(num_kv_heads),
            int32(group),
            ffi.from_buffer(smem),
        )

    # lto: the C function is inlined into the kernel (no ABI call, no callee-saved registers).
    return cuda.jit(
        fastmath=False,
        lto=True,
        launch_bounds=(num_threads(head_dim), MIN_BLOCKS[head_dim]),
    )(kernel)


def paged_attention_fa_cuda(
    q,  # [T, H, D] fp16
    k_cache,  # [num_blocks, num_kv_heads, 16, D] fp16
    v_cache,
    block_tables,  # [B, W] int32
    seq_lens,  # [B] int32
    query_start_loc,  # [B + 1] int32
    scale: float,
    out=None,
    *,
    max_query_len: int | None = None,
):
    """Causal paged attention on torch's current stream; returns out [T, H, D]. The arguments of
    attention_ref.paged_attention_ref, plus out (written in place when given) and max_query_len:
    the longest q_len in the batch; it fixes the grid. When absent it is read from
    query_start_loc (a host sync). Raises ValueError for a shape this kernel does not cover
    (fa_group); `paged_attention_cuda` sends those to the CUDA-core kernel."""
    import torch

    T, H, D = q.shape
    kvh = k_cache.shape[1]
    check_paged_cache(
        q,
        k_cache,
        v_cache,
        BLOCK_SIZE,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    group = fa_group(H, kvh, D)
    B = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if out.shape != q.shape or out.dtype != torch.float16 or not out.is_contiguous():
        raise ValueError("out must be a contiguous fp16 tensor shaped like q")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if B else 0
    if B == 0 or T == 0 or max_query_len == 0:
        return out
    q = q.contiguous()
    for name, t in (("q", q), ("out", out)):  # the caches: check_paged_cache
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (16-byte vector loads and stores)")
    tile_q = ROWS // group
    grid = ((max_query_len + tile_q - 1) // tile_q, kvh, B)
    args = (
        out.view(-1),
        q.view(-1),
        k_cache.view(-1),
        v_cache.view(-1),
        block_tables.contiguous(),
        seq_lens.contiguous(),
        query_start_loc.contiguous(),
        float(scale),
        kvh,
        group,
    )
    launch(prefill_fa_kernel(D), grid, num_threads(D), args, current_stream())
    return out


def paged_attention_cuda(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    out=None,
    *,
    max_query_len: int | None = None,
):
    """The dispatch entry for prefill attention (kernels/dispatch.py): this kernel where it
    covers the shape (head dims 64, 128 and 256, up to ROWS query heads per KV head), the
    CUDA-core kernel of attention/prefill.py otherwise. Arguments: those of
    paged_attention_fa_cuda."""
    if q.shape[2] in HEAD_DIMS and q.shape[1] // k_cache.shape[1] <= ROWS:
        fn = paged_attention_fa_cuda  # (a head count that is no multiple of the KV heads' raises)
    else:
        from voltserve.kernels.attention.prefill import paged_attention_cuda as fn
    return fn(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        out,
        max_query_len=max_query_len,
    )


# Representative instances that `voltserve check-kernels` compiles (see kernels/registry.py).
if not SIM:
    prefill_fa_kernel_d128 = prefill_fa_kernel(128)
    prefill_fa_kernel_d64 = prefill_fa_kernel(64)
    prefill_fa_kernel_d256 = prefill_fa_kernel(256)
