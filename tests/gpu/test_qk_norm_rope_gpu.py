"""The fused q/k RMSNorm + rotary + KV-cache write launcher on a real GPU at the Qwen3-30B-A3B
(32 q heads, 4 KV heads) and Qwen3-8B (32 q heads, 8 KV heads) attention shapes, head_dim 128,
q/k/v as strided row views of the fused qkv output, against qk_norm_rope_and_cache_ref; and
captured in a CUDA graph, replayed on new inputs, positions and slots."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 128, 16, 600  # 9600 slots: room for T = 8192
MAX_POS, THETA, EPS = 40960, 1000000.0, 1e-6  # Qwen3's rope and norm settings
SHAPES = {"qwen3-30b-a3b": (32, 4), "qwen3-8b": (32, 8)}
F16_ULP = dict(atol=2e-3, rtol=2e-3)  # one fp16 ulp at |x| <= 2, relative beyond
EXACT = dict(equal_nan=True, atol=0, rtol=0)


def split(qkv: torch.Tensor, heads: int, kv_heads: int):
    return qkv.split([heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=-1)


def fresh_inputs(T: int, heads: int, kv_heads: int, dtype=torch.float16):
    qkv = torch.randn(T, (heads + 2 * kv_heads) * HEAD_DIM, device=DEV, dtype=dtype) * 3
    positions = torch.randint(0, MAX_POS, (T,), device=DEV, dtype=torch.int64)
    positions[0] = MAX_POS - 1  # the last row of the cos/sin cache
    if T > 2:
        positions[-1] = 0
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=DEV)[:T].to(torch.int64)
    slots[1::5] = -1  # padding rows (T = 1 keeps its one real row)
    return qkv, positions, slots


def weights(dtype=torch.float16):
    g = torch.Generator(device=DEV).manual_seed(0)
    q_w = torch.rand(HEAD_DIM, device=DEV, generator=g) + 0.5
    k_w = torch.rand(HEAD_DIM, device=DEV, generator=g) + 0.5
    return q_w.to(dtype), k_w.to(dtype)


def poisoned_caches(kv_heads: int, dtype=torch.float16):
    shape = (NUM_BLOCKS, kv_heads, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), device=DEV, dtype=dtype)
    return k_cache, k_cache.clone()


def cos_sin():
    from voltserve.kernels.attention.rotary import build_cos_sin_cache

    return build_cos_sin_cache(HEAD_DIM, MAX_POS, THETA).to(DEV)


def check(qkv, qkv_in, positions, slots, cache, q_w, k_w, k_cache, v_cache, heads, kv_heads):
    """qkv / caches after the kernel, against the reference run on qkv_in (the inputs)."""
    from voltserve.kernels.attention.qk_norm_rope import qk_norm_rope_and_cache_ref

    qkv_ref = qkv_in.clone()
    k_ref, v_ref = poisoned_caches(kv_heads, k_cache.dtype)
    q, k, v = split(qkv_ref, heads, kv_heads)
    qk_norm_rope_and_cache_ref(
        positions, q, k, v, q_w, k_w, EPS, HEAD_DIM, cache, True, k_ref, v_ref, slots
    )
    torch.cuda.synchronize()
    q_size = heads * HEAD_DIM
    # k and v in the buffer untouched; q and k within the bound of tests/rotary_tolerance.py
    # (a normalised element may round the other way), nearly all of them bit for bit
    assert torch.equal(qkv[:, q_size:], qkv_in[:, q_size:])
    torch.testing.assert_close(v_cache, v_ref, **EXACT)
    if qkv.dtype == torch.float16:
        from voltserve.kernels.attention.kv_cache import reshape_and_cache_ref
        from voltserve.kernels.elementwise.rmsnorm import rms_norm_ref

        from tests.rotary_tolerance import assert_within, rotated_bound

        T = qkv.shape[0]
        q_in, k_in, _ = split(qkv_in, heads, kv_heads)
        qn = rms_norm_ref(q_in.reshape(-1, HEAD_DIM), q_w, EPS).view(T, -1)
        kn = rms_norm_ref(k_in.reshape(-1, HEAD_DIM), k_w, EPS).view(T, kv_heads, HEAD_DIM)
        # the normalised k laid out as the cache holds the rotated one: bounds row by row
        kn_cache, _ = poisoned_caches(kv_heads)
        reshape_and_cache_ref(kn, kn, kn_cache, kn_cache.clone(), slots)
        q_ref = qkv_ref[:, :q_size]
        assert_within(qkv[:, :q_size], q_ref, rotated_bound(qn, HEAD_DIM, HEAD_DIM, q_ref))
        rows = (kn_cache.view(-1, HEAD_DIM), HEAD_DIM, HEAD_DIM, k_ref.view(-1, HEAD_DIM))
        assert_within(k_cache, k_ref, rotated_bound(*rows).view_as(k_cache))
        assert (qkv != qkv_ref).float().mean().item() < 0.01
    else:
        torch.testing.assert_close(qkv.float(), qkv_ref.float(), **F16_ULP)
        torch.testing.assert_close(k_cache.float(), k_ref.float(), equal_nan=True, **F16_ULP)
    written = int((slots >= 0).sum())
    assert int((~torch.isnan(k_cache)).sum()) == written * kv_heads * HEAD_DIM
    assert int((~torch.isnan(v_cache)).sum()) == written * kv_heads * HEAD_DIM


def run_once(T, heads, kv_heads, dtype=torch.float16):
    from voltserve.kernels.attention.qk_norm_rope import fusable, qk_norm_rope_and_cache_cuda

    cache = cos_sin()
    q_w, k_w = weights(dtype)
    qkv, positions, slots = fresh_inputs(T, heads, kv_heads, dtype)
    qkv_in = qkv.clone()
    k_cache, v_cache = poisoned_caches(kv_heads, dtype)
    q, k, v = split(qkv, heads, kv_heads)
    args = (positions, q, k, v, q_w, k_w, EPS, HEAD_DIM, cache, True, k_cache, v_cache, slots)
    assert fusable(*args[:6], *args[7:])  # the kernel, not the fallback
    qk_norm_rope_and_cache_cuda(*args)
    check(qkv, qkv_in, positions, slots, cache, q_w, k_w, k_cache, v_cache, heads, kv_heads)


@pytest.mark.parametrize("T", [1, 8, 256, 8192])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_qk_norm_rope_gpu(T, shape):
    run_once(T, *SHAPES[shape])


@pytest.mark.parametrize("T", [1, 256])
def test_qk_norm_rope_gpu_fp32(T):
    run_once(T, *SHAPES["qwen3-8b"], dtype=torch.float32)


def test_qk_norm_rope_gpu_fallback():
    """GPT-J style is outside the kernel: the launcher runs the separate kernels, with the
    reference's result."""
    from voltserve.kernels.attention.qk_norm_rope import (
        qk_norm_rope_and_cache_cuda,
        qk_norm_rope_and_cache_ref,
    )

    heads, kv_heads = SHAPES["qwen3-8b"]
    cache = cos_sin()
    q_w, k_w = weights()
    qkv, positions, slots = fresh_inputs(33, heads, kv_heads)
    qkv_ref = qkv.clone()
    k_cache, v_cache = poisoned_caches(kv_heads)
    k_ref, v_ref = poisoned_caches(kv_heads)
    q, k, v = split(qkv, heads, kv_heads)
    qk_norm_rope_and_cache_cuda(
        positions, q, k, v, q_w, k_w, EPS, HEAD_DIM, cache, False, k_cache, v_cache, slots
    )
    q, k, v = split(qkv_ref, heads, kv_heads)
    qk_norm_rope_and_cache_ref(
        positions, q, k, v, q_w, k_w, EPS, HEAD_DIM, cache, False, k_ref, v_ref, slots
    )
    torch.testing.assert_close(qkv.float(), qkv_ref.float(), **F16_ULP)
    torch.testing.assert_close(v_cache, v_ref, **EXACT)
    torch.testing.assert_close(k_cache.float(), k_ref.float(), equal_nan=True, **F16_ULP)


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_qk_norm_rope_gpu_graph_capture(T, shape):
    """No host sync and no allocation inside: captured once, replayed on fresh static inputs."""
    from voltserve.kernels.attention.qk_norm_rope import qk_norm_rope_and_cache_cuda

    heads, kv_heads = SHAPES[shape]
    cache = cos_sin()
    q_w, k_w = weights()
    qkv, positions, slots = fresh_inputs(T, heads, kv_heads)
    k_cache, v_cache = poisoned_caches(kv_heads)
    q, k, v = split(qkv, heads, kv_heads)

    def step():
        qk_norm_rope_and_cache_cuda(
            positions, q, k, v, q_w, k_w, EPS, HEAD_DIM, cache, True, k_cache, v_cache, slots
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        new_qkv, new_positions, new_slots = fresh_inputs(T, heads, kv_heads)
        qkv.copy_(new_qkv)
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        graph.replay()
        check(qkv, new_qkv, positions, slots, cache, q_w, k_w, k_cache, v_cache, heads, kv_heads)


def test_dispatch_picks_fused_kernel_on_gpu():
    from voltserve.kernels.dispatch import KernelDispatch

    ops = KernelDispatch(DEV, torch.float16, force_ref=False)
    assert ops.impl["qk_norm_rope_and_cache"] == "cuda"
    assert ops.capturable(("qk_norm_rope_and_cache",))
