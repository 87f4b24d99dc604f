"""numba.cuda elementwise, KV-write and sampling kernels on a real GPU at realistic shapes.

fp16 kernels are compared two ways: against the reference run on the same fp16 inputs (within one
fp16 ulp: only fp32 reduction order differs) and against the reference in fp32 (within the stated
bounds of fp16 storage). Sampled ids equal sample_ref's except the documented boundary cases (top-p's
cut over the min-p/top-k survivors, min-p's threshold).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
F16_ULP = dict(atol=2e-3, rtol=2e-3)  # one fp16 ulp at |x| <= 2, relative beyond
F16_VS_F32 = dict(atol=1e-2, rtol=1e-2)  # two fp16 roundings against an fp32 computation


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# 12288: rows wider than the registers hold (tail re-read); 4100: not a multiple of 8 (scalar path)
# rows: a decode batch (one chunk per thread where the row fits) and a larger one.
@pytest.mark.parametrize("rows", [1, 257])
@pytest.mark.parametrize("hidden", [4096, 8192, 12288, 4100])
def test_rms_norm_gpu(hidden, rows):
    from voltserve.kernels.elementwise.rmsnorm import rms_norm_cuda, rms_norm_ref

    x = torch.randn(rows, hidden, device=DEV, dtype=torch.float16)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).half()
    out = rms_norm_cuda(x, w, 1e-6, out=nan_like(x))
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), rms_norm_ref(x, w, 1e-6).float(), **F16_ULP)
    torch.testing.assert_close(out.float(), rms_norm_ref(x.float(), w.float(), 1e-6), **F16_VS_F32)


@pytest.mark.parametrize("rows", [1, 129, 300])
@pytest.mark.parametrize("hidden", [4096, 8192, 12288, 4100])
def test_fused_add_rms_norm_gpu(hidden, rows):
    from voltserve.kernels.elementwise.rmsnorm import (
        fused_add_rms_norm_cuda,
        fused_add_rms_norm_ref,
    )

    x = torch.randn(rows, hidden, device=DEV, dtype=torch.float16)
    res = torch.randn(rows, hidden, device=DEV, dtype=torch.float16)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).half()
    x_ref, res_ref = x.clone(), res.clone()
    fused_add_rms_norm_ref(x_ref, res_ref, w, 1e-5)
    x32, r32 = x.float(), res.float()
    fused_add_rms_norm_ref(x32, r32, w.float(), 1e-5)
    fused_add_rms_norm_cuda(x, res, w, 1e-5)
    torch.cuda.synchronize()
    assert torch.equal(res, res_ref)
    torch.testing.assert_close(x.float(), x_ref.float(), **F16_ULP)
    torch.testing.assert_close(x.float(), x32, **F16_VS_F32)


def test_silu_and_mul_gpu():
    from voltserve.kernels.elementwise.activation import silu_and_mul_cuda, silu_and_mul_ref

    x = torch.randn(100, 2 * 14336, device=DEV, dtype=torch.float16) * 3
    out = silu_and_mul_cuda(x, out=nan_like(torch.empty(100, 14336, device=DEV).half()))
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), silu_and_mul_ref(x).float(), **F16_ULP)
    torch.testing.assert_close(out.float(), silu_and_mul_ref(x.float()), atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (128, 64)])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_gpu(head_dim, rotary_dim, is_neox):
    from voltserve.kernels.attention.rotary import (
        build_cos_sin_cache,
        rotary_embedding_cuda,
        rotary_embedding_ref,
    )

    T, heads, kv_heads = 300, 32, 8
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    cache = build_cos_sin_cache(rotary_dim, 131072, 500000.0, scaling).to(DEV)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, device=DEV, dtype=torch.float16)
    q = qkv[:, : heads * head_dim]  # strided views of the fused projection, as the model has
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, 131072, (T,), device=DEV, dtype=torch.int64)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, head_dim, cache, is_neox)
    q32, k32 = q.float(), k.float()
    rotary_embedding_ref(positions, q32, k32, head_dim, cache, is_neox)
    rotary_embedding_cuda(positions, q, k, head_dim, cache, is_neox)
    torch.cuda.synchronize()
    torch.testing.assert_close(q.float(), q_ref.float(), **F16_ULP)
    torch.testing.assert_close(k.float(), k_ref.float(), **F16_ULP)
    torch.testing.assert_close(q.float(), q32, **F16_VS_F32)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_reshape_and_cache_gpu(head_dim):
    from voltserve.kernels.attention.kv_cache import reshape_and_cache_cuda, reshape_and_cache_ref

    T, kv_heads, block_size, num_blocks = 500, 8, 16, 64
    qkv = torch.randn(T, 3, kv_heads, head_dim, device=DEV, dtype=torch.float16)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:T].to(torch.int64)
    slots[::7] = -1
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEV, dtype=torch.float16)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    reshape_and_cache_cuda(key, value, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, atol=0, rtol=0)


def _sampling_batch(B: int, V: int):
    logits = (torch.randn(B, V, device=DEV) * 4).half().float()  # fp16-sourced: many ties
    temp = torch.rand(B, device=DEV) * 1.5
    temp[::4] = 0.0
    top_k = torch.randint(0, 100, (B,), device=DEV, dtype=torch.int32)
    top_k[::3] = 0
    top_p = torch.rand(B, device=DEV) * 0.5 + 0.5
    top_p[1::3] = 1.0
    min_p = torch.where(torch.rand(B, device=DEV) < 0.3, 0.05, 0.0)
    seeds = torch.randint(-(2**62), 2**62, (B,), device=DEV, dtype=torch.int64)
    positions = torch.randint(0, 100000, (B,), device=DEV, dtype=torch.int64)
    return logits, temp, top_k, top_p, min_p, seeds, positions


def _filter_ambiguous(args, row: int, tol: float = 1e-5) -> bool:
    """min-p's threshold or top-p's cut (over the renormalised min-p/top-k survivors, the vLLM
    order) within rounding on this row."""
    from voltserve.kernels.sampling.sampling import sample_keep_ref

    logits, temp, top_k, top_p, min_p = (a[row : row + 1].cpu() for a in args[:5])
    t = float(temp) if float(temp) > 1e-5 else 1.0
    scaled = logits / t
    probs = torch.softmax(scaled[0].double(), -1)
    mp, p = float(min_p), float(top_p)
    if mp > 0 and ((probs - mp * probs.max()).abs() < tol * probs.max()).any():
        return True
    if p >= 1.0:
        return False
    surv = sample_keep_ref(scaled, top_k, torch.ones(1), min_p)[0]
    q = probs[surv].sort(descending=True).values
    q = q / q.sum()
    cum_before = q.cumsum(0) - q
    return bool(((cum_before - p).abs() < tol).any())


def test_sample_gpu_matches_reference():
    from voltserve.kernels.sampling.sampling import sample_cuda, sample_ref

    args = _sampling_batch(48, 128256)
    out = torch.full((48,), -7, device=DEV, dtype=torch.int64)
    got = sample_cuda(*args, out=out).cpu()
    ref = sample_ref(*args).cpu()
    for b in range(48):
        if int(got[b]) != int(ref[b]):
            assert _filter_ambiguous(args, b), (b, int(got[b]), int(ref[b]))


def test_sample_gpu_batch_invariant_and_graph_capturable():
    from voltserve.kernels.sampling.sampling import sample_cuda

    args = _sampling_batch(16, 128256)
    whole = sample_cuda(*args).cpu()
    alone = torch.cat([sample_cuda(*(a[b : b + 1] for a in args)).cpu() for b in range(16)])
    assert torch.equal(whole, alone)
    # Captured in a CUDA graph (no host sync, no allocation inside), replayed on new logits.
    out = torch.full((16,), -7, device=DEV, dtype=torch.int64)
    static = [a.clone() for a in args]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sample_cuda(*static, out=out)  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_cuda(*static, out=out)
    fresh = _sampling_batch(16, 128256)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), sample_cuda(*fresh).cpu())


def test_argmax_and_penalties_gpu():
    from voltserve.kernels.sampling.sampling import (
        apply_penalties_cuda,
        apply_penalties_ref,
        argmax_cuda,
    )

    B, V = 32, 128256
    logits = (torch.randn(B, V, device=DEV) * 4).half().float()
    assert torch.equal(argmax_cuda(logits).cpu(), logits.argmax(-1).cpu())
    prompt_mask = torch.rand(B, V, device=DEV) < 0.01
    counts = (torch.randint(0, 4, (B, V), device=DEV) * (torch.rand(B, V, device=DEV) < 0.01)).int()
    rep = torch.rand(B, device=DEV) + 0.5
    pres = torch.rand(B, device=DEV) - 0.5
    freq = torch.rand(B, device=DEV) - 0.5
    ref = logits.clone()
    apply_penalties_ref(ref, prompt_mask, counts, rep, pres, freq)
    apply_penalties_cuda(logits, prompt_mask, counts, rep, pres, freq)
    torch.cuda.synchronize()
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-6)
