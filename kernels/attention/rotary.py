"""Rotary position embedding: the cos/sin cache (with llama3, linear and YaRN scaling) and its
application to q and k in place.

The cache is [max_positions, rotary_dim] in fp32: cos in the first half, sin in the second.
NeoX style rotates the two halves of the rotary dims; GPT-J style rotates adjacent pairs. Only
the first rotary_dim dims of each head rotate (partial rotary); the rest pass through.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq_default(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _inv_freq_llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn(
    base: float, rotary_dim: int, s: dict[str, Any], max_pos: int
) -> tuple[torch.Tensor, float]:
    # transformers' reading of the keys: factor absent -> max positions over the original ones;
    # attention_factor absent -> from mscale / mscale_all_dim where both are set (DeepSeek's
    # form), else from the factor; truncate (default on) rounds the correction range outwards.
    orig = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / orig
    beta_fast, beta_slow = s.get("beta_fast") or 32.0, s.get("beta_slow") or 1.0
    mscale = s.get("attention_factor")
    if mscale is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        if m and m_all:
            mscale = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
        else:
            mscale = _yarn_mscale(factor)

    def correction_dim(n_rot: float) -> float:
        return (rotary_dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    interp, extrap = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    ramp = torch.clamp((torch.arange(rotary_dim // 2).float() - low) / (high - low), 0, 1)
    extrap_factor = 1 - ramp
    inv_freq = interp * (1 - extrap_factor) + extrap * extrap_factor
    return inv_freq, float(mscale)


def build_cos_sin_cache(
    rotary_dim: int,
    max_positions: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32 (cos | sin), the same values transformers computes."""
    attention_scaling = 1.0
    kind = (rope_scaling or {}).get("rope_type") or (rope_scaling or {}).get("type") or "default"
    if kind == "default":
        inv_freq = _inv_freq_default(base, rotary_dim)
    elif kind == "linear":
        inv_freq = _inv_freq_default(base, rotary_dim) / rope_scaling["factor"]
    elif kind == "llama3":
        inv_freq = _inv_freq_llama3(_inv_freq_default(base, rotary_dim), rope_scaling)
    elif kind == "yarn":
        inv_freq, attention_scaling = _yarn(base, rotary_dim, rope_scaling, max_positions)
    elif kind == "freq_factors":
        # One divisor per frequency, as a GGUF file's rope_freqs tensor carries them (llama.cpp's
        # form of Llama 3.1's rope scaling).
        factors = torch.tensor(rope_scaling["factors"], dtype=torch.float32)
        inv_freq = _inv_freq_default(base, rotary_dim) / factors
    else:
        raise ValueError(
            f"unsupported rope scaling type {kind!r} "
            "(supported: default, linear, llama3, yarn, freq_factors)"
        )
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, rotary_dim]; cos/sin: [T, 1, rotary_dim // 2], in x's dtype (as transformers).
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        return x * c + torch.cat([-x2, x1], dim=-1) * s
    x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.stack([o1, o2], dim=-1).flatten(-2)


def rotary_embedding_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, num_heads * head_dim]
    k: torch.Tensor,  # [T, num_kv_heads * head_dim]
    head_dim: int,
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32
    is_neox: bool = True,
) -> None:
    """Rotates q and k in place."""
    rotary_dim = cos_sin_cache.shape[1]
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs.chunk(2, dim=-1)
    cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
    for t in (q, k):
        v = t.view(t.shape[0], -1, head_dim)
        v[..., :rotary_dim] = _rotate(v[..., :rotary_dim], cos, sin, is_neox)


# ---------------------------------------------------------------------------------------------
# numba.cuda kernel: one block per token. Both styles reduce to o1 = x1*c - x2*s,
# o2 = x2*c + x1*s on a pair (x1, x2) that is (j, j + half) for NeoX and (2j, 2j + 1) for GPT-J.
# Like the reference, cos/sin are rounded to q's dtype and every product and sum is rounded to the
# storage dtype, so fp16 results match it bit for bit.
# With `vec` (half a multiple of 8, aligned views: vec_ok) threads walk (head, 8 pairs) items with
# 16-byte accesses: NeoX reads 8 elements from each half, GPT-J 16 adjacent elements. Otherwise
# threads walk (head, pair) items element by element.

from numba import cuda  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.numba_common import (  # noqa: E402
    current_stream,
    float32,
    launch,
    round_like,
)
from voltserve.kernels.runtime.vec_io import VEC, ld8, st8, tup8, vec_ok  # noqa: E402

BLOCK = 128


@cuda.jit(device=True, inline="always")
def _rot1(x1, x2, c, s, x):
    o1 = round_like(round_like(x1 * c, x) - round_like(x2 * s, x), x)
    o2 = round_like(round_like(x2 * c, x) + round_like(x1 * s, x), x)
    return o1, o2


@cuda.jit(device=True)
def _rotate_pair(x, t, i1, i2, c, s):
    o1, o2 = _rot1(float32(x[t, i1]), float32(x[t, i2]), c, s, x)
    x[t, i1] = o1
    x[t, i2] = o2


@cuda.jit(device=True, inline="always")
def _rotate_chunk(x, t, base, j, half, cs, sn, is_neox):
    """Rotates the 8 pairs j..j+7 of the head starting at column base (vector path)."""
    o = cuda.local.array(16, float32)
    if is_neox:
        a = ld8(x, (t, base + j))
        b = ld8(x, (t, base + half + j))
        for e in range(VEC):
            o[e], o[VEC + e] = _rot1(a[e], b[e], cs[e], sn[e], x)
        st8(x, (t, base + j), tup8(o, 0))
        st8(x, (t, base + half + j), tup8(o, VEC))
    else:
        a = ld8(x, (t, base + 2 * j))
        b = ld8(x, (t, base + 2 * j + VEC))
        for e in range(VEC // 2):
            o[2 * e], o[2 * e + 1] = _rot1(a[2 * e], a[2 * e + 1], cs[e], sn[e], x)
            o[VEC + 2 * e], o[VEC + 2 * e + 1] = _rot1(
                b[2 * e], b[2 * e + 1], cs[VEC // 2 + e], sn[VEC // 2 + e], x
            )
        st8(x, (t, base + 2 * j), tup8(o, 0))
        st8(x, (t, base + 2 * j + VEC), tup8(o, VEC))


@cuda.jit(device=True, inline="always")
def rotate_row(t, pos, q, k, head_dim, cos_sin_cache, is_neox, vec):
    """Rotates row t of q and k at position pos; the block's threads share the (head, pair)
    items. The kernel below, and the first half of rotary_cache.rotary_and_cache_kernel."""
    half = cos_sin_cache.shape[1] // 2
    q_heads = q.shape[1] // head_dim
    heads = q_heads + k.shape[1] // head_dim
    if vec:
        chunks = half // VEC
        e = cuda.threadIdx.x
        while e < heads * chunks:
            h = e // chunks
            j = (e - h * chunks) * VEC
            c8 = ld8(cos_sin_cache, (pos, j))
            s8 = ld8(cos_sin_cache, (pos, half + j))
            cs = cuda.local.array(8, float32)
            sn = cuda.local.array(8, float32)
            for i in range(VEC):
                cs[i] = round_like(c8[i], q)
                sn[i] = round_like(s8[i], q)
            if h < q_heads:
                _rotate_chunk(q, t, h * head_dim, j, half, cs, sn, is_neox)
            else:
                _rotate_chunk(k, t, (h - q_heads) * head_dim, j, half, cs, sn, is_neox)
            e += cuda.blockDim.x
        return
    e = cuda.threadIdx.x
    while e < heads * half:
        h = e // half
        j = e - h * half
        c = round_like(cos_sin_cache[pos, j], q)
        s = round_like(cos_sin_cache[pos, half + j], q)
        if is_neox:
            i1 = j
            i2 = j + half
        else:
            i1 = 2 * j
            i2 = 2 * j + 1
        if h < q_heads:
            _rotate_pair(q, t, h * head_dim + i1, h * head_dim + i2, c, s)
        else:
            kh = h - q_heads
            _rotate_pair(k, t, kh * head_dim + i1, kh * head_dim + i2, c, s)
        e += cuda.blockDim.x


@cached
@cuda.jit
def rotary_embedding_kernel(positions, q, k, head_dim, cos_sin_cache, is_neox, vec):
    t = cuda.blockIdx.x
    rotate_row(t, positions[t], q, k, head_dim, cos_sin_cache, is_neox, vec)


def rotary_embedding_cuda(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Same meaning as rotary_embedding_ref (in place). q/k: [T, heads * head_dim] (row views of
    the fused qkv output are fine); positions int64; cos_sin_cache fp32."""
    if q.shape[0]:
        launch(
            rotary_embedding_kernel,
            q.shape[0],
            BLOCK,
            rotary_args(positions, q, k, head_dim, cos_sin_cache, is_neox),
            current_stream(),
        )


def rotary_args(positions, q, k, head_dim: int, cos_sin_cache, is_neox: bool) -> tuple:
    """The rotary part of a kernel's arguments (rotary_embedding_kernel, and the first seven of
    rotary_cache.rotary_and_cache_kernel): positions, q/k as 2-D rows, head_dim, the cos/sin
    cache, is_neox, and whether the 16-byte vector path applies."""
    q2, k2 = q.view(q.shape[0], -1), k.view(k.shape[0], -1)
    half = cos_sin_cache.shape[1] // 2
    vec = half % VEC == 0 and head_dim % VEC == 0 and vec_ok(q2, k2, cos_sin_cache)
    return (
        positions,
        q2,
        k2,
        int(head_dim),
        cos_sin_cache,
        bool(is_neox),
        vec,
    )
