"""Writing new keys and values into a one-byte (fp8) paged KV cache: kv_cache.py's layout and
slot rule, elements stored as uint8 codes (attention/fp8.py: e5m2 = the rounded top byte of the
fp16 value; e4m3 = value / scale, saturated). The conversion is fp8_convert.encode, in software.
"""

from __future__ import annotations

import torch
from voltserve.kernels.attention import fp8
from voltserve.kernels.attention.kv_cache import div_rem, slot_positions


def reshape_and_cache_fp8_ref(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # uint8 [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, negative = skip
    fmt: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    valid, blocks, offsets = slot_positions(slot_mapping, k_cache.shape[2])
    k_cache[blocks, :, offsets] = fp8.quantize(key[valid], fmt, k_scale)
    v_cache[blocks, :, offsets] = fp8.quantize(value[valid], fmt, v_scale)


# ---------------------------------------------------------------------------------------------
# numba.cuda kernel: one block per token, threads walk its num_kv_heads * head_dim elements (one
# byte written per element; the conversion's arithmetic, not the traffic, bounds this write,
# which moves a few KB per token).

from numba import cuda, float32  # noqa: E402
from voltserve.kernels.attention.fp8_convert import encode  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.numba_common import current_stream, launch  # noqa: E402

BLOCK = 128


@cached
@cuda.jit
def reshape_and_cache_fp8_kernel(
    key, value, k_cache, v_cache, slot_mapping, e4m3, k_scale, v_scale
):
    t = cuda.blockIdx.x
    slot = slot_mapping[t]
    if slot < 0:
        return
    blk, off = div_rem(slot, k_cache.shape[2])
    heads, head_dim = key.shape[1], key.shape[2]
    e = cuda.threadIdx.x
    while e < heads * head_dim:
        h, d = div_rem(e, head_dim)
        k_cache[blk, h, off, d] = encode(float32(key[t, h, d]), e4m3, k_scale)
        v_cache[blk, h, off, d] = encode(float32(value[t, h, d]), e4m3, v_scale)
        e += cuda.blockDim.x


def reshape_and_cache_fp8_cuda(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Same meaning as reshape_and_cache_fp8_ref; key/value fp16 (strided views allowed)."""
    if fmt not in fp8.FORMATS:
        raise ValueError(f"unknown fp8 format {fmt!r}; expected one of {fp8.FORMATS}")
    if key.shape[0]:
        args = (
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            fmt == fp8.E4M3,
            float(k_scale),
            float(v_scale),
        )
        launch(reshape_and_cache_fp8_kernel, key.shape[0], BLOCK, args, current_stream())
