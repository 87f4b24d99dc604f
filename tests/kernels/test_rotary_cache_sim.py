"""The fused rotary + KV-cache write kernel against rotary_and_cache_ref in the CUDA simulator
(fresh random inputs, NaN-poisoned cache, padding slots, partial rotary, both styles, fp16 and
fp32, q/k/v as strided row views of one fused qkv buffer), plus the host-side pieces that need
no kernel: dispatch resolution and the graph-safe torch fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from voltserve.kernels import dispatch
from voltserve.kernels.attention import rotary_cache
from voltserve.kernels.attention.rotary import build_cos_sin_cache
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.kernels.runtime.numba_common import SIM, launch

sim_only = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")

DTYPES = [torch.float32, torch.float16]
SCALING = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}


def sim_view(t: torch.Tensor):
    """A simulator device array over t's own memory. The simulator copies plain numpy arguments
    in and out, which would break the aliasing the kernel relies on (k passed as rows and as a
    [T, kv_heads, head_dim] view of the same qkv buffer)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(t.numpy())


def make_inputs(dtype, T, heads, kv_heads, head_dim, rotary_dim, num_blocks, block_size):
    cache = build_cos_sin_cache(rotary_dim, 64, 10000.0, SCALING)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.randint(0, 64, (T,), dtype=torch.int64)
    slots = torch.randperm(num_blocks * block_size)[:T].to(torch.int64)
    slots[1::3] = -1  # padding rows: rotated, never written to the cache
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    return qkv, positions, slots, cache, k_cache, k_cache.clone()


def split(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    return qkv.split([q_size, kv_size, kv_size], dim=-1)


@sim_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    "head_dim,rotary_dim,vec_rot,vec_cache",
    # full and partial rotary on the 16-byte paths; the scalar paths; half = 4 (rotary can only
    # go element by element) with a vectorised cache copy
    [(32, 32, True, True), (32, 16, True, True), (32, 16, False, False), (16, 8, False, True)],
)
def test_rotary_and_cache_kernel(dtype, is_neox, head_dim, rotary_dim, vec_rot, vec_cache):
    T, heads, kv_heads, block_size, num_blocks = 5, 3, 2, 4, 3
    qkv, positions, slots, cache, k_cache, v_cache = make_inputs(
        dtype, T, heads, kv_heads, head_dim, rotary_dim, num_blocks, block_size
    )
    qkv_ref, k_ref, v_ref = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = split(qkv_ref, heads, kv_heads, head_dim)
    rotary_cache.rotary_and_cache_ref(
        positions, q, k, v, head_dim, cache, is_neox, k_ref, v_ref, slots
    )

    q, k, v = split(qkv, heads, kv_heads, head_dim)
    assert not q.is_contiguous()  # row views of the fused buffer, as the model passes them
    key, value = k.view(T, kv_heads, head_dim), v.view(T, kv_heads, head_dim)
    args = (positions.numpy(), sim_view(q), sim_view(k), head_dim, cache.numpy(), is_neox)
    args += (vec_rot, sim_view(key), sim_view(value), k_cache.numpy(), v_cache.numpy())
    launch(rotary_cache.rotary_and_cache_kernel, T, 32, args + (slots.numpy(), vec_cache))

    if dtype == torch.float16:
        # Every product and sum rounds like the reference's fp16 ops, and the cache is a copy.
        assert torch.equal(qkv, qkv_ref)
    else:
        torch.testing.assert_close(qkv, qkv_ref, atol=1e-5, rtol=1e-5)
    # The cache holds the kernel's own rotated k (bit for bit) and v at the real rows' slots,
    # and the poison everywhere else.
    exact = dict(equal_nan=True, atol=0, rtol=0)
    k_own, v_own = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    rotary_cache.reshape_and_cache_ref(key, value, k_own, v_own, slots)
    torch.testing.assert_close(k_cache, k_own, **exact)
    torch.testing.assert_close(v_cache, v_own, **exact)
    tol = exact if dtype == torch.float16 else dict(equal_nan=True, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, k_ref, **tol)
    torch.testing.assert_close(v_cache, v_ref, **exact)
    written = (slots >= 0).sum().item()
    assert (~torch.isnan(k_cache)).sum().item() == written * kv_heads * head_dim


def test_dispatch_resolves_fused_op() -> None:
    assert KernelDispatch("cpu", force_ref=False).impl["rotary_and_cache"] == "ref"
    # Resolving touches no device: the launcher is found by name for fp16 and fp32.
    for dtype in (torch.float16, torch.float32):
        assert KernelDispatch("cuda", dtype, force_ref=False).impl["rotary_and_cache"] == "cuda"
    assert "rotary_and_cache" in dispatch.DECODE_GRAPH_OPS
    # No numba launcher for bf16: the reference syncs, so only the graph fallback is capturable.
    ops = KernelDispatch("cuda", torch.bfloat16, force_ref=False)
    assert ops.impl["rotary_and_cache"] == "ref"
    assert not ops.capturable(("rotary_and_cache",))
    ops = KernelDispatch("cuda", torch.bfloat16, force_ref=False, graph_torch_fallback=True)
    assert ops.impl["rotary_and_cache"] == "torch-capturable"
    assert ops.capturable(("rotary_and_cache",))
    assert KernelDispatch("cuda", force_ref=True).impl["rotary_and_cache"] == "ref"


@pytest.mark.parametrize("is_neox", [True, False])
def test_capturable_fallback_equals_reference(is_neox) -> None:
    T, heads, kv_heads, head_dim, block_size, num_blocks = 7, 4, 2, 16, 4, 5
    qkv, positions, slots, cache, k_cache, v_cache = make_inputs(
        torch.float32, T, heads, kv_heads, head_dim, 8, num_blocks + 1, block_size
    )
    qkv2, k2, v2 = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = split(qkv, heads, kv_heads, head_dim)
    rotary_cache.rotary_and_cache_ref(
        positions, q, k, v, head_dim, cache, is_neox, k_cache, v_cache, slots
    )
    q, k, v = split(qkv2, heads, kv_heads, head_dim)
    dispatch._rotary_and_cache_capturable(
        positions, q, k, v, head_dim, cache, is_neox, k2, v2, slots
    )
    assert torch.equal(qkv2, qkv)
    # Identical except the scratch block (the last), where padding rows land.
    exact = dict(equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(k2[:num_blocks], k_cache[:num_blocks], **exact)
    torch.testing.assert_close(v2[:num_blocks], v_cache[:num_blocks], **exact)


def test_ref_is_rotary_then_cache() -> None:
    # The fused reference on its own terms: equal to the two references it names, in order.
    from voltserve.kernels.attention.kv_cache import reshape_and_cache_ref
    from voltserve.kernels.attention.rotary import rotary_embedding_ref

    T, heads, kv_heads, head_dim = 6, 4, 2, 32
    qkv, positions, slots, cache, k_cache, v_cache = make_inputs(
        torch.float16, T, heads, kv_heads, head_dim, 16, 3, 4
    )
    qkv2, k2, v2 = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = split(qkv, heads, kv_heads, head_dim)
    rotary_cache.rotary_and_cache_ref(
        positions, q, k, v, head_dim, cache, True, k_cache, v_cache, slots
    )
    q, k, v = split(qkv2, heads, kv_heads, head_dim)
    rotary_embedding_ref(positions, q, k, head_dim, cache, True)
    key, value = k.view(T, kv_heads, head_dim), v.view(T, kv_heads, head_dim)
    reshape_and_cache_ref(key, value, k2, v2, slots)
    assert torch.equal(qkv, qkv2)
    assert np.array_equal(k_cache.numpy(), k2.numpy(), equal_nan=True)
    assert np.array_equal(v_cache.numpy(), v2.numpy(), equal_nan=True)
