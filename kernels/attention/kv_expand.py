"""Widening the pages of a one-byte (fp8) KV cache that a step reads into an fp16 workspace of
the cache's shape, so the fp16 attention kernels (decode.py at every batch size, its split-KV
and merge forms; prefill.py / prefill_fa.py for prefill and chunked prefill) run on it
unchanged: same block ids, same block tables.

Why expand rather than convert per tile inside the attention kernels: the decode kernel is
generated code whose lanes each own one 16-byte load of 8 fp16 values and whose register budget
is tuned around that layout (the online and block cores, each in direct / split / merge form),
and the flash prefill's key loop is CUDA C; an fp8 layout (16 values per 16-byte load) would be a
second variant of each, many more specialisations to compile and test. The expansion costs one
extra pass per layer and step over the pages the step reads (1 byte read, 2 written, then the
attention's 2 read per element), so the one-byte cache buys capacity (about twice the blocks),
not decode bandwidth. Only the blocks of the block tables' columns below each sequence's length
are written; the grid depends only on the tables' width (CUDA-graph safe, no host sync).
"""

from __future__ import annotations

import torch
from voltserve.kernels.attention import fp8


def expand_kv_pages_ref(
    k_cache: torch.Tensor,  # uint8 [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    k_ws: torch.Tensor,  # fp16/fp32, the cache's shape
    v_ws: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    fmt: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    bs = k_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[b, : -(-n // bs)].long()
        k_ws[blocks] = fp8.dequantize(k_cache[blocks], fmt, k_scale, k_ws.dtype)
        v_ws[blocks] = fp8.dequantize(v_cache[blocks], fmt, v_scale, v_ws.dtype)


# ---------------------------------------------------------------------------------------------
# numba.cuda kernel: grid (table column, KV head, sequence); the block's threads walk the
# block_size * head_dim elements of that page (contiguous in both tensors). Decoding is a load
# from the format's 256-entry table (fp8_convert.decode_table).

from numba import cuda  # noqa: E402
from voltserve.kernels.attention.fp8_convert import decode_table  # noqa: E402
from voltserve.kernels.attention.kv_cache import div_rem  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.numba_common import current_stream, launch  # noqa: E402

THREADS = 128


@cached
@cuda.jit
def expand_kv_pages_kernel(
    k_cache, v_cache, k_ws, v_ws, block_tables, seq_lens, table, k_scale, v_scale
):
    col = cuda.blockIdx.x
    h = cuda.blockIdx.y
    b = cuda.blockIdx.z
    bs, hd = k_cache.shape[2], k_cache.shape[3]
    if col * bs >= seq_lens[b]:
        return
    blk = block_tables[b, col]
    i = cuda.threadIdx.x
    while i < bs * hd:
        t, d = div_rem(i, hd)
        k_ws[blk, h, t, d] = table[k_cache[blk, h, t, d]] * k_scale
        v_ws[blk, h, t, d] = table[v_cache[blk, h, t, d]] * v_scale
        i += cuda.blockDim.x


_TABLES: dict = {}


def expand_kv_pages_cuda(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_ws: torch.Tensor,
    v_ws: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    fmt: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Same meaning as expand_kv_pages_ref; workspaces fp16. The decoding table is made once per
    (format, device), outside any graph capture's first use (the runner's eager warm-up)."""
    key = (fmt, k_cache.device)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = decode_table(fmt, k_cache.device)
    B, W = block_tables.shape
    if B == 0 or W == 0:
        return
    args = (
        k_cache,
        v_cache,
        k_ws,
        v_ws,
        block_tables,
        seq_lens,
        table,
        float(k_scale),
        float(v_scale),
    )
    launch(expand_kv_pages_kernel, (W, k_cache.shape[1], B), THREADS, args, current_stream())
