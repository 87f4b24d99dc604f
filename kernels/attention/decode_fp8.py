"""Paged decode attention over a one-byte (fp8) KV cache, reading the codes directly: every lane's
16-byte load brings 16 codes, widened in registers next to their use (kv_widen.py), so a decode
step reads one byte per K or V element instead of the two of an fp16 cache, or the 1 + 2 + 2 of
expanding the pages into an fp16 workspace first (kv_expand.py, which prefill keeps).

Meaning: `paged_decode_attention_fp8_ref`, the fp16 decode's reference (attention/ref.py) over
the dequantized pages (attention/fp8.py). Layout: kv_cache.py, elements uint8 codes.

The kernel is decode.py's generated kernel with the cache's storage as one more field of its
config (DecodeConfig.kv): the same work split, partitions, online and block cores, direct /
split / in-kernel-merge forms and launch choices, CUDA-graph rules (the grid depends only on the
shapes and the context bound; no host sync), the same merge kernel. What differs per storage:
- 16 values a lane per load instead of 8, so a token row takes half the lanes (8 at head_dim
  128), a warp pass covers twice the tokens, and a lane holds 16 q values and 16 PV sums per
  query head: at most 4 heads share a block (decode.max_heads_per_block; fp16 takes 8) and the
  online core takes head groups up to 3 x 256 dims (online_max_group_dims), so register use
  per block stays where fp16's is. A KV head's query heads that 4 does not divide (7 per KV
  head: Qwen2.5) are spread over blocks of fewer heads, each reading the KV head again (from L2
  when the blocks run together).
- widening: e5m2 codes are the top bytes of fp16s (two integer ops per four codes); e4m3 codes
  become fp16s of value x 2^-8 by moving bits (five integer ops per four codes, no table), the
  2^8 and the layer's k_scale folded into q's multiplier (with the softmax scale) and the 2^8
  and v_scale into the PV sums once per partition. kv_widen.py says why bits and not a shared
  table.

NaN: e5m2 keeps it (an fp16 NaN). The e4m3 NaN codes widen to +-480 x scale, not NaN; the cache
write stores them only for a NaN key or value, i.e. a token whose activations were already NaN,
whose own logits are non-finite (the executor fails that request).
"""

from __future__ import annotations

import math

import torch
from voltserve.kernels.attention import fp8, kv_widen
from voltserve.kernels.attention.common import check_paged_cache
from voltserve.kernels.attention.decode import (
    BLOCK_SIZE,
    decode_config,
    decode_kernel,
    launch_decode,
)
from voltserve.kernels.attention.ref import paged_decode_attention_ref


def paged_decode_attention_fp8_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # uint8 [num_blocks, num_kv_heads, block_size, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    fmt: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention over the dequantized pages (fp32), cast to q's dtype."""
    k = fp8.dequantize(k_cache, fmt, k_scale)
    v = fp8.dequantize(v_cache, fmt, v_scale)
    out = paged_decode_attention_ref(q.float(), k, v, block_tables, seq_lens, scale)
    return out.to(q.dtype)


def check_scales(fmt: str, k_scale: float, v_scale: float) -> None:
    """A format of attention/fp8.py; e4m3 scales finite and positive, e5m2 none (its range is
    fp16's: a scale would be a second meaning of the same codes)."""
    if fmt not in fp8.FORMATS:
        raise ValueError(f"unknown fp8 format {fmt!r}; expected one of {fp8.FORMATS}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"{name} must be finite and positive, got {s}")
        if fmt == fp8.E5M2 and s != 1.0:
            raise ValueError(f"{name} {s}: fp8_e5m2 takes no scale (only fp8_e4m3 does)")


def paged_decode_attention_fp8_cuda(
    q,  # [B, H, D] fp16
    k_cache,  # uint8 [num_blocks, num_kv_heads, 16, D]
    v_cache,
    block_tables,  # [B, W] int32
    seq_lens,  # [B] int32
    scale: float,
    out=None,
    *,
    fmt: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_seq_len: int | None = None,
    partition_size: int | None = None,
    workspace=None,
    num_threads: int | None = None,
    max_registers: int | None = -1,
    online: bool | None = None,
    prefetch: bool = False,
):
    """Decode attention on torch's current stream over a one-byte cache of format `fmt`
    (attention/fp8.py: "fp8_e5m2" or "fp8_e4m3"; k_scale / v_scale: e4m3's per-layer scales);
    returns out [B, H, D] fp16. Every other argument is decode.paged_decode_attention_cuda's,
    with the same meaning (max_seq_len fixes the grid for CUDA graphs; workspace as there)."""
    check_scales(fmt, k_scale, v_scale)
    check_paged_cache(
        q,
        k_cache,
        v_cache,
        BLOCK_SIZE,
        cache_dtype=torch.uint8,
        block_tables=block_tables,
        seq_lens=seq_lens,
    )
    factor = kv_widen.scale_factor(fmt)
    return launch_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale * k_scale * factor, out, max_seq_len,
        partition_size, workspace, num_threads, max_registers, online, fmt, v_scale * factor,
        prefetch,
    )  # fmt: skip


# Representative instances that `voltserve check-kernels` compiles (kernels/attention/__init__.py),
# few because each is a long compile: each format and each core once, at Llama-3-8B's shape
# (128 dims, 4 heads per KV head): the block core over e4m3 (split), the online core over e5m2
# (in-kernel merge, the batch-1 kernel). The other shapes and forms are the same generated code
# with other constants (decode.py's instances compile them for fp16).
_E5, _E4 = fp8.E5M2, fp8.E4M3
decode_fp8_kernel_d128_g4_e4m3 = decode_kernel(decode_config(32, 8, 128, kv=_E4), "split")
decode_fp8_kernel_d128_g4_e5m2_online = decode_kernel(
    decode_config(32, 8, 128, 64, online=True, kv=_E5), "merge"
)
