"""The one-byte (fp8) KV cache kernels against torch in numba's CUDA simulator: the software
conversions against torch's float8 casts, the cache write, and the page expansion feeding the
fp16 decode (split-KV path) and chunked-prefill kernels, each checked against a reference that
rounds K and V itself with torch.float8_e5m2 / torch.float8_e4m3fn. Outputs are poisoned
before every launch."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # as test_attention_sim.py: standalone under the simulator
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from voltserve.kernels.attention.fp8_convert import (  # noqa: E402
    E4M3_FORMAT,
    E5M2_FORMAT,
    decode_table,
    encode_fp8,
)
from voltserve.kernels.attention.kv_cache_fp8 import reshape_and_cache_fp8_kernel  # noqa: E402
from voltserve.kernels.attention.kv_expand import expand_kv_pages_kernel  # noqa: E402

from tests.kernels.test_attention_sim import (  # noqa: E402
    BLOCK_SIZE,
    make_cache,
    reference,
    run_decode,
    run_prefill,
)
from tests.kv_rounding import codes, rounded  # noqa: E402

POISON = 0xA5  # a code no test value rounds to by chance in the checked slots


FORMATS = {"fp8_e5m2": E5M2_FORMAT, "fp8_e4m3": E4M3_FORMAT}


def check_encoder(fmt: str, vals: torch.Tensor) -> None:
    """The software encoder on every fp32 value of vals against torch's cast (tests/kv_rounding:
    e4m3 saturated at +-448, e5m2 past 57344 to inf); a NaN gives a code that decodes to NaN."""
    got = torch.tensor([int(encode_fp8(np.float32(v), FORMATS[fmt])) & 0xFF for v in vals.tolist()])
    want = codes(vals, fmt, 1.0).to(torch.int64)
    nan = torch.isnan(vals)
    bad = (got != want) & ~nan
    assert not bad.any(), (fmt, vals[bad][:8].tolist(), got[bad][:8].tolist())
    assert torch.isnan(decode_table(fmt)[got[nan]]).all(), f"{fmt}: NaN must stay NaN"


@pytest.mark.parametrize("fmt", ["fp8_e5m2", "fp8_e4m3"])
def test_software_encoder_every_fp16_value(fmt) -> None:
    """All 65,536 fp16 bit patterns (signed zeros, subnormals of both widths, every tie, 448 /
    57344 and past them, inf, NaN): the whole input domain of e5m2 (the cache rounds the fp16
    value) and of e4m3 at scale 1."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    check_encoder(fmt, bits.float())


def test_software_e4m3_encoder_fp32_values(seed) -> None:
    """e4m3 encodes the fp32 quotient x / scale, which fp16 does not cover: random fp32 bit
    patterns across e4m3's exponents (from under half its smallest subnormal to past 448, fp32
    subnormals, inf, NaN), the same with the bits below e4m3's mantissa an exact tie, and the
    ties and saturation edges named."""
    g = torch.Generator().manual_seed(seed)
    n = 8192
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << 31
    exp = torch.randint(127 - 12, 127 + 10, (n,), generator=g, dtype=torch.int64) << 23
    man = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int64)
    tie = (man & ~((1 << 20) - 1)) | (1 << 19)  # the top 3 mantissa bits, then exactly half
    edges = [0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F7FFFFF]
    raw = torch.cat([sign | exp | man, sign | exp | tie, torch.tensor(edges, dtype=torch.int64)])
    vals = raw.to(torch.int32).view(torch.float32)
    mids = torch.tensor([1.0625, 1.1875, 1.125 + 2**-5, 464.0, -464.0, 2**-10 * 1.5, 2**-10])
    check_encoder("fp8_e4m3", torch.cat([vals, mids]))


@pytest.mark.parametrize("fmt,k_scale,v_scale", [("fp8_e5m2", 1.0, 1.0), ("fp8_e4m3", 0.375, 2.5)])
def test_cache_write(seed, fmt, k_scale, v_scale) -> None:
    rng = np.random.default_rng(seed)
    T, H, D, n_blocks = 5, 2, 8, 3
    kv = rng.standard_normal((T, 3 * H, D)).astype(np.float16) * np.float16(40)
    # Slices of a fused qkv (the simulator takes contiguous copies; the kernel's signature takes
    # the strided views on the GPU).
    key, value = kv[:, H : 2 * H].copy(), kv[:, 2 * H :].copy()
    slots = np.array([17, -1, 0, 40, 5], np.int64)
    k_cache = np.full((n_blocks, H, BLOCK_SIZE, D), POISON, np.uint8)
    v_cache = k_cache.copy()
    reshape_and_cache_fp8_kernel[T, 32](
        key, value, k_cache, v_cache, slots, fmt == "fp8_e4m3", k_scale, v_scale
    )
    want_k = np.full_like(k_cache, POISON)
    want_v = want_k.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            b, o = divmod(int(s), BLOCK_SIZE)
            want_k[b, :, o] = codes(torch.from_numpy(key[t]), fmt, k_scale).numpy()
            want_v[b, :, o] = codes(torch.from_numpy(value[t]), fmt, v_scale).numpy()
    np.testing.assert_array_equal(k_cache, want_k)
    np.testing.assert_array_equal(v_cache, want_v)


def fp8_cache(rng, seq_lens, heads, head_dim, fmt, k_scale, v_scale):
    """A uint8 cache of random values (codes of fp16 normals x 3) with shuffled block tables,
    the same values rounded by torch (the reference's K and V), and the tables."""
    k16, v16, tables = make_cache(rng, seq_lens, heads, head_dim)
    k16, v16 = np.nan_to_num(k16) * np.float16(3), np.nan_to_num(v16) * np.float16(3)
    kt, vt = torch.from_numpy(k16), torch.from_numpy(v16)
    c = codes(kt, fmt, k_scale).numpy(), codes(vt, fmt, v_scale).numpy()
    ref = rounded(kt, fmt, k_scale).numpy(), rounded(vt, fmt, v_scale).numpy()
    return c, ref, tables


def expand(codes, tables, seq_lens, fmt, k_scale, v_scale):
    """The kernel's fp16 pages in a NaN-poisoned workspace of the cache's shape."""
    k_ws = np.full(codes[0].shape, np.nan, np.float16)
    v_ws = k_ws.copy()
    table = decode_table(fmt).numpy()
    B, W = tables.shape
    sl = np.asarray(seq_lens, np.int32)
    grid = (W, codes[0].shape[1], B)
    expand_kv_pages_kernel[grid, 32](
        codes[0], codes[1], k_ws, v_ws, tables, sl, table, k_scale, v_scale
    )
    return k_ws, v_ws


def test_expanded_pages_feed_split_decode(seed) -> None:
    """Two partitions with a partial last one (the split-KV path and its merge kernel) over
    pages expanded from an e5m2 cache (the prefill test takes e4m3: the kernel differs per
    format only in its table); each sequence's pages hold exactly the rounded values."""
    rng = np.random.default_rng(seed)
    fmt, k_scale, v_scale = "fp8_e5m2", 1.0, 1.0
    D, H, KVH, seq_lens = 64, 2, 1, [50, 5]
    codes, (k_ref, v_ref), tables = fp8_cache(rng, seq_lens, KVH, D, fmt, k_scale, v_scale)
    k_ws, v_ws = expand(codes, tables, seq_lens, fmt, k_scale, v_scale)
    for b, n in enumerate(seq_lens):
        for j in range(-(-n // BLOCK_SIZE)):
            blk = tables[b, j]
            np.testing.assert_array_equal(k_ws[blk], k_ref[blk])
            np.testing.assert_array_equal(v_ws[blk], v_ref[blk])
    q = rng.standard_normal((len(seq_lens), H, D)).astype(np.float16)
    scale = D**-0.5
    out = run_decode(q, k_ws, v_ws, tables, seq_lens, scale, max_seq_len=64)
    ref = reference(q, k_ref, v_ref, tables, seq_lens, list(range(len(seq_lens) + 1)), scale)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)


def test_expanded_pages_feed_chunked_prefill(seed) -> None:
    """A chunk of a longer sequence (q_len < seq_len) beside a whole prompt, over e4m3 pages."""
    rng = np.random.default_rng(seed)
    fmt, D, H, KVH = "fp8_e4m3", 32, 4, 2
    seq_lens, q_lens = [40, 7], [9, 7]
    codes, (k_ref, v_ref), tables = fp8_cache(rng, seq_lens, KVH, D, fmt, 0.75, 1.25)
    k_ws, v_ws = expand(codes, tables, seq_lens, fmt, 0.75, 1.25)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), H, D)).astype(np.float16)
    scale = D**-0.5
    out = run_prefill(q, k_ws, v_ws, tables, seq_lens, qsl, scale)
    ref = reference(q, k_ref, v_ref, tables, seq_lens, qsl.tolist(), scale)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)


def _numpy_launch(kernel, grid, block, args, stream=None):
    """The launchers' launch with torch CPU tensors as numpy views (the simulator's arrays); the
    simulator takes contiguous arrays only, so a strided input (K / V rows of a fused qkv) goes
    as a copy, and every output (cache, workspace) is contiguous: written in place."""
    from voltserve.kernels.runtime import numba_common

    args = tuple(
        np.ascontiguousarray(a.numpy()) if isinstance(a, torch.Tensor) else a for a in args
    )
    numba_common.launch(kernel, grid, block, args)


def test_kv_quant_through_the_cuda_launchers(seed, monkeypatch) -> None:
    """The engine's seam (kv_quant.KVQuant: write, then attend over the shared workspace) with
    the dispatch's CUDA launchers of the two one-byte ops, which the simulator runs: a step of
    two chunks (one continuing a cached prefix across a block boundary), then a decode step,
    against attention over K / V rounded by torch. The attention over the workspace is the
    reference here (its kernels read expanded pages in the tests above)."""
    from voltserve.kernels.attention import kv_cache_fp8, kv_expand
    from voltserve.kernels.attention.ref import paged_attention_ref
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.services.executor.input_batch import attention_metadata
    from voltserve.services.executor.kv_quant import GRAPH_OPS, KVQuant
    from voltserve.services.executor.kv_workspace import KVWorkspace

    cuda_ops = KernelDispatch("cuda", torch.float16, force_ref=False)  # resolving runs nothing
    assert cuda_ops.reshape_and_cache_fp8 is kv_cache_fp8.reshape_and_cache_fp8_cuda
    assert cuda_ops.expand_kv_pages is kv_expand.expand_kv_pages_cuda
    assert cuda_ops.capturable(GRAPH_OPS)
    assert not KernelDispatch("cuda", torch.bfloat16, force_ref=False).capturable(GRAPH_OPS)
    ops = KernelDispatch("cpu", torch.float16)
    ops.reshape_and_cache_fp8 = cuda_ops.reshape_and_cache_fp8
    ops.expand_kv_pages = cuda_ops.expand_kv_pages
    for mod in (kv_cache_fp8, kv_expand):
        monkeypatch.setattr(mod, "launch", _numpy_launch)
        monkeypatch.setattr(mod, "current_stream", lambda: None)
    # One warp per block (the kernels stride by blockDim): a simulated thread costs.
    monkeypatch.setattr(kv_cache_fp8, "BLOCK", 32)
    monkeypatch.setattr(kv_expand, "THREADS", 32)

    g = torch.Generator().manual_seed(seed)
    fmt, ks, vs = "fp8_e4m3", 0.625, 1.5
    H, KVH, D, n_blocks = 2, 1, 8, 5
    tables = torch.tensor([[3, 0], [4, 1]], dtype=torch.int32)  # A: blocks 3, 0; B: 4, 1
    cached = 15  # A's positions already in the cache (from earlier steps)
    k_cache = torch.full((n_blocks, KVH, BLOCK_SIZE, D), POISON, dtype=torch.uint8)
    v_cache = k_cache.clone()
    ws = KVWorkspace(torch.float16, torch.device("cpu"))
    ws.reserve(k_cache.numel())
    quant = KVQuant(fmt, ks, vs, ws)
    full_k = [torch.randn(40, KVH, D, generator=g).half() * 3 for _ in range(2)]
    full_v = [torch.randn(40, KVH, D, generator=g).half() * 3 for _ in range(2)]
    k_cache[3, :, :cached] = codes(full_k[0][:cached].transpose(0, 1), fmt, ks)
    v_cache[3, :, :cached] = codes(full_v[0][:cached].transpose(0, 1), fmt, vs)
    lens = [cached, 0]
    # Step 1: A's positions 15..17 (across its block boundary) and B's 0..1; step 2: decode.
    for new in ([3, 2], [1, 1]):
        T = sum(new)
        pos = [p for b in range(2) for p in range(lens[b], lens[b] + new[b])]
        seq = [b for b in range(2) for _ in range(new[b])]
        slots = [
            int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for b, p in zip(seq, pos)
        ]
        # K and V as strided row views of a fused qkv, as the model hands them over.
        qkv = torch.zeros(T, (H + 2 * KVH) * D, dtype=torch.float16)
        k, v = qkv[:, H * D : (H + KVH) * D], qkv[:, (H + KVH) * D :]
        for t, (b, p) in enumerate(zip(seq, pos)):
            k[t] = full_k[b][p].flatten()
            v[t] = full_v[b][p].flatten()
        lens = [lens[b] + new[b] for b in range(2)]
        qsl = torch.tensor([0, new[0], T], dtype=torch.int32)
        meta = attention_metadata(
            torch.tensor(slots), tables, torch.tensor(lens, dtype=torch.int32), qsl,
            max(new) == 1, max(new),
        )  # fmt: skip
        q = torch.randn(T, H, D, generator=g).half()
        quant.write(ops, k, v, k_cache, v_cache, meta.slot_mapping)
        out = quant.attend(ops, q, k_cache, v_cache, meta, D**-0.5)
        # The reference: every sequence's K / V so far, rounded by torch, in a fresh cache.
        ref_k = torch.zeros(n_blocks, KVH, BLOCK_SIZE, D)
        ref_v = torch.zeros_like(ref_k)
        for b in range(2):
            for p in range(lens[b]):
                blk, off = int(tables[b, p // BLOCK_SIZE]), p % BLOCK_SIZE
                ref_k[blk, :, off] = rounded(full_k[b][p].float(), fmt, ks)
                ref_v[blk, :, off] = rounded(full_v[b][p].float(), fmt, vs)
                assert torch.equal(k_cache[blk, :, off], codes(full_k[b][p], fmt, ks))
                assert torch.equal(v_cache[blk, :, off], codes(full_v[b][p], fmt, vs))
        want = paged_attention_ref(q.float(), ref_k, ref_v, tables, meta.seq_lens, qsl, D**-0.5)
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)
