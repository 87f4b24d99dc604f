"""The fused rotary + KV-cache write launcher on a real GPU at Llama shapes (32 heads, 8 KV heads,
q/k/v as strided row views of the fused qkv output), against rotary_and_cache_ref; and captured
in a CUDA graph, replayed on new inputs, positions and slots."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
HEADS, KV_HEADS, BLOCK_SIZE, NUM_BLOCKS = 32, 8, 16, 64
F16_ULP = dict(atol=2e-3, rtol=2e-3)  # one fp16 ulp at |x| <= 2, relative beyond
EXACT = dict(equal_nan=True, atol=0, rtol=0)
SCALING = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}


def split(qkv: torch.Tensor, head_dim: int):
    q_size, kv_size = HEADS * head_dim, KV_HEADS * head_dim
    return qkv.split([q_size, kv_size, kv_size], dim=-1)


def fresh_inputs(T: int, head_dim: int, dtype=torch.float16):
    qkv = torch.randn(T, (HEADS + 2 * KV_HEADS) * head_dim, device=DEV, dtype=dtype)
    positions = torch.randint(0, 131072, (T,), device=DEV, dtype=torch.int64)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=DEV)[:T].to(torch.int64)
    slots[1::5] = -1  # padding rows (T = 1 keeps its one real row)
    return qkv, positions, slots


def poisoned_caches(head_dim: int, dtype=torch.float16):
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEV, dtype=dtype)
    return k_cache, k_cache.clone()


def check(qkv, qkv_in, positions, slots, cos_sin_cache, is_neox, k_cache, v_cache, head_dim):
    """qkv / caches after the kernel, against the reference run on qkv_in (the inputs)."""
    from voltserve.kernels.attention.kv_cache import reshape_and_cache_ref
    from voltserve.kernels.attention.rotary_cache import rotary_and_cache_ref

    T = qkv.shape[0]
    qkv_ref = qkv_in.clone()
    k_ref, v_ref = poisoned_caches(head_dim, k_cache.dtype)
    q, k, v = split(qkv_ref, head_dim)
    rotary_and_cache_ref(positions, q, k, v, head_dim, cos_sin_cache, is_neox, k_ref, v_ref, slots)
    torch.cuda.synchronize()
    # q and k rotated like the reference (within one fp16 ulp), v and unrotated dims untouched
    torch.testing.assert_close(qkv.float(), qkv_ref.float(), **F16_ULP)
    _, k_out, v_out = split(qkv, head_dim)
    assert torch.equal(v_out, split(qkv_in, head_dim)[2])
    # The cache holds exactly the kernel's rotated k and v at real rows' slots, poison elsewhere.
    k_own, v_own = poisoned_caches(head_dim, k_cache.dtype)
    reshape_and_cache_ref(
        k_out.reshape(T, KV_HEADS, head_dim),
        v_out.reshape(T, KV_HEADS, head_dim),
        k_own,
        v_own,
        slots,
    )
    torch.testing.assert_close(k_cache, k_own, **EXACT)
    torch.testing.assert_close(v_cache, v_own, **EXACT)
    torch.testing.assert_close(v_cache, v_ref, **EXACT)
    torch.testing.assert_close(k_cache.float(), k_ref.float(), equal_nan=True, **F16_ULP)
    written = int((slots >= 0).sum())
    assert int((~torch.isnan(k_cache)).sum()) == written * KV_HEADS * head_dim


@pytest.mark.parametrize("T", [1, 7, 256])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (64, 64), (128, 64)])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_and_cache_gpu(T, head_dim, rotary_dim, is_neox):
    from voltserve.kernels.attention.rotary import build_cos_sin_cache
    from voltserve.kernels.attention.rotary_cache import rotary_and_cache_cuda

    cache = build_cos_sin_cache(rotary_dim, 131072, 500000.0, SCALING).to(DEV)
    qkv, positions, slots = fresh_inputs(T, head_dim)
    qkv_in = qkv.clone()
    k_cache, v_cache = poisoned_caches(head_dim)
    q, k, v = split(qkv, head_dim)
    rotary_and_cache_cuda(positions, q, k, v, head_dim, cache, is_neox, k_cache, v_cache, slots)
    check(qkv, qkv_in, positions, slots, cache, is_neox, k_cache, v_cache, head_dim)


def test_rotary_and_cache_gpu_fallback_and_contiguous():
    """int32 slots are outside what the fused kernel is registered for: the launcher falls back
    to the two kernels, with the same result. Contiguous q/k (what a q/k-norm model passes)
    take the fused kernel."""
    from voltserve.kernels.attention.rotary import build_cos_sin_cache
    from voltserve.kernels.attention.rotary_cache import rotary_and_cache_cuda

    head_dim, T = 128, 33
    cache = build_cos_sin_cache(head_dim, 131072, 500000.0, SCALING).to(DEV)
    qkv, positions, slots = fresh_inputs(T, head_dim)
    qkv_in = qkv.clone()
    k_cache, v_cache = poisoned_caches(head_dim)
    q, k, v = split(qkv, head_dim)
    rotary_and_cache_cuda(
        positions, q, k, v, head_dim, cache, True, k_cache, v_cache, slots.to(torch.int32)
    )
    check(qkv, qkv_in, positions, slots, cache, True, k_cache, v_cache, head_dim)

    qkv, positions, slots = fresh_inputs(T, head_dim)
    qkv_in = qkv.clone()
    k_cache, v_cache = poisoned_caches(head_dim)
    q, k, v = (t.contiguous() for t in split(qkv, head_dim))
    rotary_and_cache_cuda(positions, q, k, v, head_dim, cache, True, k_cache, v_cache, slots)
    qkv_out = torch.cat([q, k, v], dim=-1)
    check(qkv_out, qkv_in, positions, slots, cache, True, k_cache, v_cache, head_dim)


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_rotary_and_cache_gpu_graph_capture(T, head_dim):
    """No host sync and no allocation inside: captured once, replayed on fresh static inputs."""
    from voltserve.kernels.attention.rotary import build_cos_sin_cache
    from voltserve.kernels.attention.rotary_cache import rotary_and_cache_cuda

    cache = build_cos_sin_cache(head_dim, 131072, 500000.0, SCALING).to(DEV)
    qkv, positions, slots = fresh_inputs(T, head_dim)
    k_cache, v_cache = poisoned_caches(head_dim)
    q, k, v = split(qkv, head_dim)

    def step():
        rotary_and_cache_cuda(positions, q, k, v, head_dim, cache, True, k_cache, v_cache, slots)

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
        new_qkv, new_positions, new_slots = fresh_inputs(T, head_dim)
        qkv.copy_(new_qkv)
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        graph.replay()
        check(qkv, new_qkv, positions, slots, cache, True, k_cache, v_cache, head_dim)


def test_dispatch_picks_fused_kernel_on_gpu():
    from voltserve.kernels.dispatch import KernelDispatch

    ops = KernelDispatch(DEV, torch.float16, force_ref=False)
    assert ops.impl["rotary_and_cache"] == "cuda"
    assert ops.capturable(("rotary_and_cache",))
