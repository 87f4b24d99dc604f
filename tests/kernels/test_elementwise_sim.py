"""rmsnorm, fused add + rmsnorm, silu_and_mul, rotary and reshape_and_cache kernels against their
torch references, in the CUDA simulator, on fresh random inputs with NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.attention import kv_cache, rotary
from voltserve.kernels.elementwise import activation, rmsnorm
from voltserve.kernels.runtime.numba_common import SIM, launch

# On a GPU host the simulator is off; the GPU tests cover these kernels there.
pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


def run(kernel, grid, block: int, *args) -> None:
    """Launch with numpy views of torch tensors (shared memory, so in-place kernels update them);
    the simulator cannot take torch tensors as device arrays."""
    launch(
        kernel, grid, block, tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in args)
    )


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


DTYPES = [torch.float32, torch.float16]


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    if out.dtype == torch.float16:
        # fp32 reductions in a different order can move an fp16 result by one ulp.
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=2e-3)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# (hidden, vec): 64 on both the 16-byte path and the guarded scalar path; 300 is not a multiple
# of 8 (scalar path, partial last chunk); 1304 > MAXV * 8 * 32 exercises the re-read tail.
NORM_CASES = [(64, True), (64, False), (300, False), (1304, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,vec", NORM_CASES)
def test_rms_norm(dtype, hidden, vec):
    x = torch.randn(3, hidden, dtype=dtype) * 2
    w = torch.randn(hidden, dtype=dtype)
    out = poisoned_like(x)
    run(rmsnorm.rms_norm_kernel, 3, 32, x, w, out, 1e-6, vec)
    assert_close(out, rmsnorm.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,vec", NORM_CASES)
def test_fused_add_rms_norm(dtype, hidden, vec):
    x = torch.randn(3, hidden, dtype=dtype)
    res = torch.randn(3, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    x_ref, res_ref = x.clone(), res.clone()
    rmsnorm.fused_add_rms_norm_ref(x_ref, res_ref, w, 1e-5)
    run(rmsnorm.fused_add_rms_norm_kernel, 3, 32, x, res, w, 1e-5, vec)
    assert torch.equal(res, res_ref)  # the residual add rounds exactly like the reference
    assert_close(x, x_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm_one_chunk(dtype, hidden):
    # 200 = 25 chunks: the block's last 7 threads own no chunk but join the reduction.
    x = torch.randn(2, hidden, dtype=dtype) * 2
    w = torch.randn(hidden, dtype=dtype)
    out = poisoned_like(x)
    run(rmsnorm.rms_norm_1c_kernel, 2, rmsnorm.one_chunk_block(hidden), x, w, out, 1e-6)
    assert_close(out, rmsnorm.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_fused_add_rms_norm_one_chunk(dtype, hidden):
    x = torch.randn(2, hidden, dtype=dtype)
    res = torch.randn(2, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    x_ref, res_ref = x.clone(), res.clone()
    rmsnorm.fused_add_rms_norm_ref(x_ref, res_ref, w, 1e-5)
    block = rmsnorm.one_chunk_block(hidden)
    run(rmsnorm.fused_add_rms_norm_1c_kernel, 2, block, x, res, w, 1e-5)
    assert torch.equal(res, res_ref)
    assert_close(x, x_ref)


def test_one_chunk_choice():
    assert rmsnorm.one_chunk(1, 4096, True) and rmsnorm.one_chunk_block(4096) == 512
    assert not rmsnorm.one_chunk(1, 4096, False)  # the scalar path stays on the general kernel
    assert not rmsnorm.one_chunk(rmsnorm.SMALL_BATCH + 1, 4096, True)
    assert not rmsnorm.one_chunk(1, 8200, True)  # wider than one chunk per thread of 1024
    assert rmsnorm.one_chunk_block(896) == 128


def test_vec_ok():
    from voltserve.kernels.runtime.vec_io import vec_ok

    qkv = torch.empty(5, 48, dtype=torch.float16)
    assert vec_ok(qkv, qkv[:, 16:32], torch.empty(64))
    assert not vec_ok(qkv[:, 4:12])  # base not 16-byte aligned
    assert not vec_ok(torch.empty(5, 300, dtype=torch.float16))  # width not a multiple of 8
    assert not vec_ok(qkv[:, ::2])  # not unit stride


def test_block_size():
    # Decode batches: one 8-element chunk per thread; large batches: MAXV chunks per thread.
    assert rmsnorm.block_size(1, 4096) == 256
    assert rmsnorm.block_size(4096, 4096) == 128
    assert rmsnorm.block_size(1, 8192) == rmsnorm.MAX_BLOCK
    assert rmsnorm.block_size(4096, 896) == 32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter,vec", [(1040, True), (1040, False), (150, False)])
def test_silu_and_mul(dtype, inter, vec):
    # 1040 = 8 * 130 chunks: with 32 threads x PER_THREAD chunks a block, several column blocks
    # and a last one that is partly empty. 150 is not a multiple of 8 (guarded scalar path).
    T, block = 3, 32
    x = torch.randn(T, 2 * inter, dtype=dtype) * 3
    out = poisoned_like(torch.empty(T, inter, dtype=dtype))
    per_block = block * activation.PER_THREAD * 8
    grid = (T, (inter + per_block - 1) // per_block)
    run(activation.silu_and_mul_kernel, grid, block, x, out, vec)
    assert_close(out, activation.silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    "head_dim,rotary_dim,vec",
    # partial rotary; half = 8 allows the 16-byte path, half = 4 only the scalar one
    [(16, 8, False), (32, 16, True), (32, 16, False)],
)
def test_rotary(dtype, is_neox, head_dim, rotary_dim, vec):
    T, heads, kv_heads = 4, 3, 1
    cache = rotary.build_cos_sin_cache(
        rotary_dim,
        64,
        10000.0,
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16},
    )
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    positions = torch.randint(0, 64, (T,), dtype=torch.int64)
    q_ref, k_ref = q.clone(), k.clone()
    rotary.rotary_embedding_ref(positions, q_ref, k_ref, head_dim, cache, is_neox)
    # The simulator only takes contiguous arrays; the GPU test covers strided q/k views.
    q, k = q.contiguous(), k.contiguous()
    run(rotary.rotary_embedding_kernel, T, 32, positions, q, k, head_dim, cache, is_neox, vec)
    if dtype == torch.float16:
        # Every product and sum is rounded like the reference's fp16 ops: bit-exact.
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    else:
        assert_close(q, q_ref)
        assert_close(k, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vec", [True, False])
def test_reshape_and_cache(dtype, vec):
    T, kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 5
    key = torch.randn(T, kv_heads, head_dim, dtype=dtype)
    value = torch.randn(T, kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size)[:T].to(torch.int64)
    slots[2] = -1  # padding: skipped
    k_cache = torch.full((num_blocks, kv_heads, block_size, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_cache.reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    run(kv_cache.reshape_and_cache_kernel, T, 32, key, value, k_cache, v_cache, slots, vec)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, atol=0, rtol=0)


def test_rms_norm_launchers_pass_eps_as_the_registered_type(monkeypatch):
    """Every rmsnorm launcher hands eps over as the scalar type kernels/registry.py lists for it,
    so the kernel that runs is the specialisation the cc 7.0 check compiles (a Python float
    made numba compile a float64 one at run time)."""
    import numba
    from numba.core import sigutils
    from voltserve.kernels import registry

    seen = []
    monkeypatch.setattr(rmsnorm, "launch", lambda k, g, b, args, s: seen.append((k, args)))
    monkeypatch.setattr(rmsnorm, "current_stream", lambda: None)
    w = torch.ones(64)
    for rows in (2, 300):  # the one-chunk kernels (decode) and the general ones
        x = torch.randn(rows, 64)
        rmsnorm.rms_norm_cuda(x, w, 1e-6)
        rmsnorm.fused_add_rms_norm_cuda(x, x.clone(), w, 1e-6)
    registered = {
        s.attr: s.signatures[0] for s in registry.kernels() if s.module == "elementwise.rmsnorm"
    }
    assert len({k for k, _ in seen}) == 4
    for kernel, args in seen:
        name = next(n for n, sig in registered.items() if getattr(rmsnorm, n) is kernel)
        want = sigutils.normalize_signature(registered[name])[0][3]
        assert numba.typeof(args[3]) == want, (name, type(args[3]))
