"""The fused q/k RMSNorm + rotary + KV-cache write kernel against qk_norm_rope_and_cache_ref in the
CUDA simulator (fresh random inputs, NaN-poisoned caches, padding slots, positions at both ends of
the cos/sin cache, full and partial rotary, fp16 and fp32, q/k/v as strided row views of one fused
qkv buffer, warps past the last head), plus the host-side pieces that need no kernel: what the
kernel covers, dispatch resolution and the graph-safe torch fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from voltserve.kernels import dispatch
from voltserve.kernels.attention import qk_norm_rope
from voltserve.kernels.attention.rotary import build_cos_sin_cache
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.kernels.runtime.numba_common import SIM, launch

sim_only = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")

MAX_POS = 64
# Large enough against mean(x^2) ~ 1 that a wrong or missing eps moves every value.
EPS = 0.25
SCALING = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}
EXACT = dict(equal_nan=True, atol=0, rtol=0)


def sim_view(t: torch.Tensor):
    """A simulator device array over t's own memory (the simulator copies plain numpy arguments
    in and out, which would lose the in-place write to the q view of the qkv buffer)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(t.numpy())


def make_inputs(dtype, T, heads, kv_heads, head_dim, rotary_dim, num_blocks, block_size):
    cos_sin = build_cos_sin_cache(rotary_dim, MAX_POS, 10000.0, SCALING)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.randint(0, MAX_POS, (T,), dtype=torch.int64)
    positions[0], positions[-1] = MAX_POS - 1, 0  # both ends of the cos/sin cache
    # Distinct slots, never the cache's last (where a write through slot -1 would land: block
    # -1); row 0 at the start of a block other than the first, the others past their start.
    cand = torch.randperm(num_blocks * block_size - 1)
    first = cand[(cand % block_size == 0) & (cand >= block_size)][:1]
    slots = torch.cat([first, cand[cand % block_size != 0][: T - 1]]).to(torch.int64)
    slots[1::3] = -1  # padding rows: q normalised and rotated, nothing written to the cache
    q_w = (torch.rand(head_dim) + 0.5).to(dtype)
    k_w = (torch.rand(head_dim) + 0.5).to(dtype)
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    return qkv, positions, slots, cos_sin, q_w, k_w, k_cache, k_cache.clone()


def split(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    return qkv.split([q_size, kv_size, kv_size], dim=-1)


@sim_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "head_dim,rotary_dim,warps",
    # full rotary at 2 and 4 elements per lane; partial rotary (half the dims pass through);
    # the launcher's 4 warps a block
    [(64, 64, 2), (128, 128, 2), (128, 64, 2), (64, 64, qk_norm_rope.WARPS)],
)
def test_qk_norm_rope_kernel(dtype, head_dim, rotary_dim, warps):
    # 3 x (3 + 2) = 15 (token, head) warps: the last block has warps with nothing to do.
    T, heads, kv_heads, block_size, num_blocks = 3, 3, 2, 4, 3
    qkv, positions, slots, cos_sin, q_w, k_w, k_cache, v_cache = make_inputs(
        dtype, T, heads, kv_heads, head_dim, rotary_dim, num_blocks, block_size
    )
    qkv_in = qkv.clone()
    qkv_ref, k_ref, v_ref = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = split(qkv_ref, heads, kv_heads, head_dim)
    qk_norm_rope.qk_norm_rope_and_cache_ref(
        positions, q, k, v, q_w, k_w, EPS, head_dim, cos_sin, True, k_ref, v_ref, slots
    )

    q, k, v = split(qkv, heads, kv_heads, head_dim)
    assert not q.is_contiguous()  # row views of the fused buffer, as the model passes them
    args = qk_norm_rope.kernel_args(
        positions, q, k, v, q_w, k_w, EPS, head_dim, cos_sin, k_cache, v_cache, slots,
        as_array=sim_view,
    )  # fmt: skip
    launch(qk_norm_rope.qk_norm_rope_kernel, qk_norm_rope.grid(T, heads + kv_heads, warps),
           32 * warps, args)  # fmt: skip

    # k and v in the qkv buffer are left as they came; q is normalised and rotated in place.
    q_size = heads * head_dim
    assert torch.equal(qkv[:, q_size:], qkv_in[:, q_size:])
    if dtype == torch.float16:
        # The sum of squares adds in another order than torch's mean (and 1/sqrt is not rsqrt),
        # so an element may round the other way: within an fp16 ulp of the reference, and most
        # of them bit for bit (the roundings of the normalised value and of every rotary
        # product are the reference's).
        tol = dict(atol=4e-3, rtol=4e-3)
        assert (qkv[:, :q_size] != qkv_ref[:, :q_size]).float().mean().item() < 0.05
    else:
        tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv, qkv_ref, **tol)
    # v is copied; k is the reference's within tolerance; padding rows' slots stay poisoned.
    torch.testing.assert_close(v_cache, v_ref, **EXACT)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **tol)
    written = (slots >= 0).sum().item()
    assert (~torch.isnan(k_cache)).sum().item() == written * kv_heads * head_dim
    assert (~torch.isnan(v_cache)).sum().item() == written * kv_heads * head_dim


def test_ref_is_the_unfused_path() -> None:
    """The reference is, bit for bit, what the model ran before the fused op: rms_norm_ref on the
    heads of q and of k (new tensors), then rotary_and_cache_ref."""
    from voltserve.kernels.attention.rotary_cache import rotary_and_cache_ref
    from voltserve.kernels.elementwise.rmsnorm import rms_norm_ref

    T, heads, kv_heads, head_dim = 6, 4, 2, 64
    qkv, positions, slots, cos_sin, q_w, k_w, k_cache, v_cache = make_inputs(
        torch.float16, T, heads, kv_heads, head_dim, 64, 3, 4
    )
    qkv2, k2, v2 = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = split(qkv, heads, kv_heads, head_dim)
    qk_norm_rope.qk_norm_rope_and_cache_ref(
        positions, q, k, v, q_w, k_w, 1e-6, head_dim, cos_sin, True, k_cache, v_cache, slots
    )
    q, k, v = split(qkv2, heads, kv_heads, head_dim)
    qn = rms_norm_ref(q.reshape(-1, head_dim), q_w, 1e-6).view(T, -1)
    kn = rms_norm_ref(k.reshape(-1, head_dim), k_w, 1e-6).view(T, -1)
    rotary_and_cache_ref(positions, qn, kn, v, head_dim, cos_sin, True, k2, v2, slots)
    assert torch.equal(qkv[:, : heads * head_dim], qn)
    assert torch.equal(qkv[:, heads * head_dim :], qkv2[:, heads * head_dim :])
    assert np.array_equal(k_cache.numpy(), k2.numpy(), equal_nan=True)
    assert np.array_equal(v_cache.numpy(), v2.numpy(), equal_nan=True)


def _covered(**change) -> bool:
    T, heads, kv_heads, head_dim = 2, 4, 2, change.pop("head_dim", 128)
    rotary_dim = change.pop("rotary_dim", head_dim)
    dtype = change.pop("dtype", torch.float16)
    qkv, positions, slots, cos_sin, q_w, k_w, k_cache, v_cache = make_inputs(
        dtype, T, heads, kv_heads, head_dim, rotary_dim, 2, 4
    )
    q, k, v = split(qkv, heads, kv_heads, head_dim)
    args = dict(
        positions=positions, q=q, k=k, v=v, q_weight=q_w, k_weight=k_w, head_dim=head_dim,
        cos_sin_cache=cos_sin, is_neox=True, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slots,
    )  # fmt: skip
    args.update(change)
    return qk_norm_rope.fusable(**args)


def test_what_the_kernel_covers() -> None:
    assert _covered()  # Qwen3: head_dim 128, full NeoX rotary, fp16
    assert _covered(head_dim=64) and _covered(head_dim=256) and _covered(dtype=torch.float32)
    assert _covered(rotary_dim=64)  # partial rotary whose pairs stay in a lane
    assert not _covered(is_neox=False)  # GPT-J style
    assert not _covered(rotary_dim=32)  # pairs 16 apart: another lane
    assert _covered(head_dim=96, rotary_dim=64)  # 3 elements a lane
    assert not _covered(head_dim=80, rotary_dim=64)  # not a multiple of 32
    assert not _covered(head_dim=512)
    assert not _covered(dtype=torch.bfloat16)
    assert not _covered(slot_mapping=torch.zeros(2, dtype=torch.int32))
    assert not _covered(k_weight=torch.ones(128, dtype=torch.float32))


@pytest.mark.parametrize(
    "device,dtype,kw,env,want",
    [
        ("cpu", torch.float32, {}, None, True),  # the reference, like the separate ops
        ("cuda", torch.float16, {"force_ref": True}, None, True),
        ("cuda", torch.bfloat16, {}, None, True),  # no numba kernels for bf16: references
        ("cuda", torch.bfloat16, {"graph_torch_fallback": True}, None, True),
        ("cuda", torch.float16, {}, "0", False),  # switched off: the separate kernels
    ],
)
def test_model_takes_the_op_where_it_stands_in(monkeypatch, device, dtype, kw, env, want):
    """Outside the kernel, the model calls the op only where it computes as the separate ops
    would; the arguments are not looked at then."""
    if env is not None:
        monkeypatch.setenv("VOLTSERVE_QK_NORM_ROPE", env)
    ops = KernelDispatch(device, dtype, **{"force_ref": False, **kw})
    assert ops.impl["qk_norm_rope_and_cache"] != "cuda"
    assert qk_norm_rope.covers(ops.impl, *[None] * 13) is want
    if env is not None:
        assert ops.capturable()  # the separate kernels: decode graphs as before


def test_covers_takes_the_ops_arguments_on_the_kernel_path():
    """Where the op is the kernel, `covers` gets what the model passes to the op (eps after
    the weights, 13 arguments) and asks `fusable` about the tensors."""
    T, heads, kv_heads, head_dim = 2, 4, 2, 128
    qkv, positions, slots, cos_sin, q_w, k_w, k_cache, v_cache = make_inputs(
        torch.float16, T, heads, kv_heads, head_dim, head_dim, 2, 4
    )
    q, k, v = split(qkv, heads, kv_heads, head_dim)
    args = (positions, q, k, v, q_w, k_w, 1e-6, head_dim, cos_sin, True, k_cache, v_cache, slots)
    impl = {"qk_norm_rope_and_cache": "cuda", "rotary_and_cache": "cuda", "rms_norm": "cuda"}
    assert qk_norm_rope.covers(impl, *args)
    assert not qk_norm_rope.covers(impl, *args[:9], False, *args[10:])  # the tensors decide


def test_dispatch_resolves_the_op() -> None:
    assert KernelDispatch("cpu", force_ref=False).impl["qk_norm_rope_and_cache"] == "ref"
    for dtype in (torch.float16, torch.float32):
        ops = KernelDispatch("cuda", dtype, force_ref=False)
        assert ops.impl["qk_norm_rope_and_cache"] == "cuda"
    # Left to the ops it stands in for (see dispatch.DECODE_GRAPH_OPS): switched off, it is a
    # reference the model never calls, and decode graphs stay on.
    assert "qk_norm_rope_and_cache" not in dispatch.DECODE_GRAPH_OPS
    assert {"rms_norm", "rotary_and_cache"} <= set(dispatch.DECODE_GRAPH_OPS)
    ops = KernelDispatch("cuda", torch.bfloat16, force_ref=False)
    assert ops.impl["qk_norm_rope_and_cache"] == "ref"
    assert not ops.capturable(("qk_norm_rope_and_cache",))
    ops = KernelDispatch("cuda", torch.bfloat16, force_ref=False, graph_torch_fallback=True)
    assert ops.impl["qk_norm_rope_and_cache"] == "torch-capturable"
    assert ops.capturable(("qk_norm_rope_and_cache",))
    assert KernelDispatch("cuda", force_ref=True).impl["qk_norm_rope_and_cache"] == "ref"


def test_capturable_fallback_equals_reference() -> None:
    T, heads, kv_heads, head_dim, block_size, num_blocks = 7, 4, 2, 32, 4, 5
    qkv, positions, slots, cos_sin, q_w, k_w, k_cache, v_cache = make_inputs(
        torch.float32, T, heads, kv_heads, head_dim, 32, num_blocks + 1, block_size
    )
    qkv2, k2, v2 = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = split(qkv, heads, kv_heads, head_dim)
    qk_norm_rope.qk_norm_rope_and_cache_ref(
        positions, q, k, v, q_w, k_w, EPS, head_dim, cos_sin, True, k_cache, v_cache, slots
    )
    q, k, v = split(qkv2, heads, kv_heads, head_dim)
    dispatch._qk_norm_rope_and_cache_capturable(
        positions, q, k, v, q_w, k_w, EPS, head_dim, cos_sin, True, k2, v2, slots
    )
    assert torch.equal(qkv2, qkv)
    # Identical except the scratch block (the last), where padding rows land.
    torch.testing.assert_close(k2[:num_blocks], k_cache[:num_blocks], **EXACT)
    torch.testing.assert_close(v2[:num_blocks], v_cache[:num_blocks], **EXACT)
