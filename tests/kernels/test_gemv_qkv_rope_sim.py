"""The qkv GEMV with rotary and the KV-cache write in its epilogue (kernels/linear/gemv_qkv_rope.py)
against its reference (F.linear, then rotary_and_cache_ref) in the CUDA simulator: fresh random
inputs, NaN-poisoned output and caches, padding slots, bias on and off, fp16 and fp32; and the
host-side pieces (supports, dispatch, the model routing on the CPU)."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.attention.rotary import build_cos_sin_cache
from voltserve.kernels.linear import gemv, gemv_qkv_rope
from voltserve.kernels.runtime.numba_common import SIM, launch

sim_only = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
SCALING = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}


def make(dtype, M, K, n_q, n_kv, D, with_bias, block_size=4, num_blocks=3):
    N = (n_q + 2 * n_kv) * D
    x = torch.randn(M, K, dtype=dtype)
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    bias = torch.randn(N, dtype=dtype) if with_bias else None
    positions = torch.randint(1, 64, (M,), dtype=torch.int64)  # 0 would not rotate q (see below)
    slots = torch.randperm(num_blocks * block_size)[:M].to(torch.int64)
    if M > 1:
        slots[1] = -1  # a padding row: rotated into out, never written to the cache
    cache = build_cos_sin_cache(D, 64, 10000.0, SCALING)
    k_cache = torch.randn(num_blocks, n_kv, block_size, D).to(dtype)
    return x, w, bias, positions, cache, k_cache, torch.randn_like(k_cache), slots


def run_kernel(x, w, bias, positions, cache, k_cache, v_cache, slots, n_q, n_kv):
    M, N = x.shape[0], w.shape[0]
    out = torch.full((M, N), float("nan"), dtype=x.dtype)
    b = bias if bias is not None else w[0]
    arrays = (x, w, b, out, positions, cache, k_cache, v_cache, slots)
    x_, w_, b_, out_, pos_, cache_, kc_, vc_, sl_ = (t.numpy() for t in arrays)
    # One warp per block: the simulator's shuffle is exact only within a one-warp block.
    launch(
        gemv.gemv_kernel(M, gemv.QKV_ROPE),
        N // 2,
        32,
        (x_, w_, b_, out_, bias is not None, pos_, cache_, kc_, vc_, sl_, n_q, n_kv),
    )
    return out


@sim_only
@pytest.mark.parametrize(
    "dtype,M,K,with_bias",
    # M = 1 with a guarded 264-element step; M = 2 with a padding row (the GPU tests take the
    # full steps and M = 3..8: each case costs tens of seconds here)
    [(torch.float32, 1, 264, False), (torch.float16, 2, 24, True)],
)
def test_qkv_rope_kernel_matches_reference(dtype, M, K, with_bias):
    # One simulated warp per rotary pair: head_dim 8 keeps them to 16 (q, k and v heads, each
    # with 4 pairs)
    n_q, n_kv, D = 2, 1, 8
    x, w, bias, positions, cache, k_cache, v_cache, slots = make(
        dtype, M, K, n_q, n_kv, D, with_bias
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = gemv_qkv_rope.gemv_qkv_rope_ref(
        x.float(),
        w.float(),
        None if bias is None else bias.float(),
        positions,
        cache,
        k_ref,
        v_ref,
        slots,
        n_q,
        n_kv,
    )
    # The caches start random, so comparing them whole also checks that only the slots of
    # non-padding rows were written.
    out = run_kernel(x, w, bias, positions, cache, k_cache, v_cache, slots, n_q, n_kv)
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    tol = dict(atol=8e-3, rtol=8e-3) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref, **tol)
    torch.testing.assert_close(k_cache.float(), k_ref.float(), **tol)
    torch.testing.assert_close(v_cache.float(), v_ref.float(), **tol)
    written = slots[slots >= 0]
    assert len(written) >= 1
    # q was rotated (not just copied): it differs from the plain product somewhere.
    plain = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert not torch.allclose(out[:, : n_q * D].float(), plain[:, : n_q * D], **tol)


def test_host_side_and_dispatch(monkeypatch):
    from voltserve.kernels.dispatch import KernelDispatch

    n_q, n_kv, D = 2, 1, 16
    x, w, bias, positions, cache, k_cache, v_cache, slots = make(
        torch.float32, 2, 24, n_q, n_kv, D, True
    )
    args = (positions, cache, k_cache, v_cache, slots, n_q, n_kv)
    assert not gemv_qkv_rope.supports_qkv_rope(x, w, *args)  # CPU tensors: the reference
    k0, v0 = k_cache.clone(), v_cache.clone()
    out = gemv_qkv_rope.gemv_qkv_rope_cuda(x, w, bias, *args)
    ref = gemv_qkv_rope.gemv_qkv_rope_ref(x, w, bias, positions, cache, k0, v0, slots, n_q, n_kv)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(k_cache, k0)
    monkeypatch.delenv("VOLTSERVE_GEMV", raising=False)
    assert KernelDispatch("cpu").impl["gemv_qkv_rope"] == "ref"
    assert KernelDispatch("cuda").impl["gemv_qkv_rope"] == "cuda"  # resolving touches no device
    monkeypatch.setenv("VOLTSERVE_GEMV", "0")
    assert KernelDispatch("cuda").impl["gemv_qkv_rope"] == "ref"


def test_model_decode_routes_through_the_fused_op():
    """On the CPU a decode step of <= 8 rows takes the fused op (its reference) for every layer,
    and the logits equal those of the unfused path (prefill rows never take it)."""
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.services.executor.linear_plan import LinearPlan
    from voltserve.services.executor.loader import load_model

    from tests.checkpoints import checkpoint
    from tests.engine.test_linear_plan import _decode_logits, _spy

    model = load_model(checkpoint("llama"), torch.float32, torch.device("cpu")).model
    ops = KernelDispatch("cpu", torch.float32)
    calls = _spy(ops, ("gemv_qkv_rope", "rotary_and_cache"))
    fused = _decode_logits(model, ops, 2, 5, seed=3)
    n = model.arch.num_layers
    # prefill: rotary_and_cache per layer; decode: the fused op per layer
    assert calls.count("gemv_qkv_rope") == n and calls.count("rotary_and_cache") == n
    calls.clear()
    ops.linear_plan = LinearPlan.fixed(gemv=False)  # qkv on cuBLAS: the unfused path
    unfused = _decode_logits(model, ops, 2, 5, seed=3)
    assert calls.count("gemv_qkv_rope") == 0 and calls.count("rotary_and_cache") == 2 * n
    torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=1e-5)
