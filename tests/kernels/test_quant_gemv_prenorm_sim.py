"""The pre-norm quantized GEMVs (kernels/quant_gemv.py: gemv.py's residual add + RMSNorm prologue
in the plain, gate_up and qkv_rope kernels of group-quantized weights) against the composed
references (fused_add_rms_norm_ref, then the quantized linear) in the CUDA simulator, through the
public launchers (`quant_*_prenorm_cuda`, with is_cuda, dev and the stream patched): M = 1 and 2,
the forms the defaults pick for fp16 x (half2 for int4 groups >= 32, factored for int8 and int4
group 16) and fp32's per-weight form, split-K (the int4 one-row default, KS = 2; KS = 4 for
qkv_rope at 8-warp blocks), outputs and residual_out poisoned with NaN; and the host side
(checks, fallbacks, the quant_linear entry points, the references).

Sizes are small (the simulator runs a Python thread per GPU thread). A warp chunk is 1024 int4 /
512 int8 inputs: K = 2304 at the int4 one-row default (R = 4, U = 1, KS = 2) gives warp 0 of a
group two steps (the peeled first step, one loop step) and warp 1 a partial one."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from voltserve.kernels import quant_gemv, quant_linear
from voltserve.kernels.activation import silu_and_mul_ref
from voltserve.kernels.gemv import prenorm_ref
from voltserve.kernels.numba_common import SIM
from voltserve.kernels.quant_pack import dequantize, pack_group_quant
from voltserve.kernels.rotary import build_cos_sin_cache

sim_only = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
EPS = 1e-5
PLAIN, GATE_UP, QKV_ROPE = quant_gemv.PLAIN, quant_gemv.GATE_UP, quant_gemv.QKV_ROPE


@pytest.fixture(autouse=True)
def _short_gil_slices():
    """The simulator busy-polls its threads at every barrier (test_gemv_prenorm_sim.py)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def sim_launch(monkeypatch):
    """The launchers as on a GPU: CPU tensors pass as CUDA ones, numpy arrays as device arrays."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(quant_gemv, "dev", lambda t: t.detach().numpy())
    monkeypatch.setattr(quant_gemv, "current_stream", lambda: 0)


def make_weight(N, K, bits, g, dtype, perm=None):
    codes = torch.randint(0, 2**bits, (N, K), dtype=torch.uint8)
    G = K // g
    s = (torch.rand(N, G) + 0.5) * (2.0 / (K**0.5 * 2**bits))
    o = -s * 2 ** (bits - 1) + torch.randn(N, G) * 0.01
    return pack_group_quant(codes, s, o, bits, g, dtype, perm)


def make_rows(M, K, dtype):
    x = torch.randn(M, K).to(dtype)
    residual = (torch.randn(M, K) * 2).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(K)).to(dtype)
    return x, residual, norm_w


def make_rope(M, n_q, n_kv, D, dtype, bs=4, blocks=3):
    positions = torch.randint(1, 64, (M,), dtype=torch.int64)
    slots = torch.randperm(blocks * bs)[:M].to(torch.int64)
    if M > 1:
        slots[1] = -1  # a padding row: rotated into out, never written to the cache
    cache = build_cos_sin_cache(D, 64, 10000.0, None)
    k_cache = torch.randn(blocks, n_kv, bs, D).to(dtype)
    v_cache = torch.randn(blocks, n_kv, bs, D).to(dtype)
    return positions, cache, k_cache, v_cache, slots, n_q, n_kv


def reference(kind, x, residual, norm_w, w, bias, rope=()):
    """(output, residual + x, caches after the step): xn from gemv.prenorm_ref in the storage
    dtype, the linear in fp32 on the dequantized weight (no fp16 torch linear: the kernel sums
    in fp32 and rounds once), rounded where the unfused ops store it."""
    res = torch.empty_like(x)
    xn = prenorm_ref(x, residual, norm_w, EPS, res).float()
    b = None if bias is None else bias.float()
    y = F.linear(xn, dequantize(w, torch.float32), b)
    if kind == PLAIN:
        return y, res, ()
    if kind == GATE_UP:
        return silu_and_mul_ref(y.to(x.dtype).float()).to(x.dtype).float(), res, ()
    positions, cache, k_cache, v_cache, slots, n_q, n_kv = rope
    kc, vc = k_cache.float(), v_cache.float()
    out = quant_gemv.quant_qkv_rope_ref(xn, w, b, positions, cache, kc, vc, slots, n_q, n_kv)
    return out, res, (kc, vc)


LAUNCHERS = {
    PLAIN: quant_gemv.quant_gemv_prenorm_cuda,
    GATE_UP: quant_gemv.quant_gemv_gate_up_prenorm_cuda,
    QKV_ROPE: quant_gemv.quant_qkv_rope_prenorm_cuda,
}
# Output tolerances (|y| ~ 1; the normalised input is compared exactly through residual_out):
# the half2 form's fp16 runs (~4e-4 of max |y|, quant_gemv's doc), one fp16 rounding of the
# output, and for gate_up / qkv_rope the epilogue's second rounding.
TOL = {torch.float16: dict(atol=8e-3, rtol=8e-3), torch.float32: dict(atol=1e-4, rtol=1e-4)}


def check(kind, M, K, N, bits, g, dtype, with_bias, rope=None, tile=None, form=None):
    w = make_weight(N, K, bits, g, dtype)
    x, residual, norm_w = make_rows(M, K, dtype)
    bias = torch.randn(N).to(dtype) if with_bias else None
    cols = N // 2 if kind == GATE_UP else N
    out = torch.full((M, cols), float("nan"), dtype=dtype)
    res_out = torch.full_like(x, float("nan"))
    assert quant_gemv.supports_prenorm(x, w, residual, norm_w, res_out, out, kind, tile)
    rope = rope or ()
    mine = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in rope)
    x0, r0 = x.clone(), residual.clone()
    got = LAUNCHERS[kind](
        x,
        residual,
        norm_w,
        EPS,
        w,
        bias,
        *mine,
        residual_out=res_out,
        out=out,
        tile=tile,
        form=form,
    )
    ref, res_ref, caches = reference(kind, x, residual, norm_w, w, bias, rope)
    assert got is out and not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    assert torch.equal(res_out, res_ref), "residual_out is not residual + x in the storage dtype"
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs left as they are
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    for got_c, want_c in zip(mine[2:4], caches):  # whole caches: only live slots written
        torch.testing.assert_close(got_c.float(), want_c, **TOL[dtype])


# (M, K, N, bits, g, bias, dtype, tile): the default tiles and forms unless given.
PLAIN_CASES = [
    # int4 g128, one row: half2, (4, 1, 2) split-K; N = 5: the second group half used
    (1, 2304, 5, 4, 128, True, torch.float16, None),
    # int4 g32, two rows: half2, (4, 2, 1); two of the block's four warps past the rows
    (2, 2560, 6, 4, 32, False, torch.float16, None),
    # int8 g32, one row: factored, (2, 2, 1); K: the peeled step and a partial loop step
    (1, 1152, 3, 8, 32, True, torch.float16, None),
    # int4 g16 (SPLIT, two groups a chunk), two rows: factored
    (2, 512, 4, 4, 16, False, torch.float16, None),
    # fp32: the per-weight form, int8, two rows
    (2, 640, 3, 8, 64, True, torch.float32, None),
]


@sim_only
@pytest.mark.parametrize("M,K,N,bits,g,with_bias,dtype,tile", PLAIN_CASES)
def test_plain_prenorm(sim_launch, seed, M, K, N, bits, g, with_bias, dtype, tile):
    print(f"seed {seed}")
    check(PLAIN, M, K, N, bits, g, dtype, with_bias, tile=tile)


@sim_only
@pytest.mark.parametrize(
    "M,K,inter,bits,g,with_bias",
    # int4 one row: half2, (4, 1, 2), 3 columns (the second group half used); int8 two rows:
    # factored, (2, 2, 1)
    [(1, 2304, 3, 4, 128, False), (2, 640, 5, 8, 32, True)],
)
def test_gate_up_prenorm(sim_launch, seed, M, K, inter, bits, g, with_bias):
    print(f"seed {seed}")
    check(GATE_UP, M, K, 2 * inter, bits, g, torch.float16, with_bias)


@sim_only
def test_qkv_rope_prenorm_two_rows(sim_launch, seed):
    """int4 g32, half2, (2, 2, 1): 2 q heads and 1 kv head of dim 8 (16 pairs, 4 blocks)."""
    print(f"seed {seed}")
    n_q, n_kv, D = 2, 1, 8
    rope = make_rope(2, n_q, n_kv, D, torch.float16)
    check(QKV_ROPE, 2, 512, (n_q + 2 * n_kv) * D, 4, 32, torch.float16, True, rope)


@sim_only
def test_qkv_rope_prenorm_split_k_wide_blocks(sim_launch, monkeypatch, seed):
    """int4 g128, one row, tile (2, 2, 2) in 8-warp blocks (PRENORM_WARPS = 8: the split-K sums'
    array sized for them): 6 pairs, 4 a block, so the second block's last two groups are past
    the pairs (clamped rows, no range, no writes)."""
    print(f"seed {seed}")
    monkeypatch.setattr(quant_gemv, "PRENORM_WARPS", 8)
    n_q, n_kv, D = 1, 1, 4
    rope = make_rope(1, n_q, n_kv, D, torch.float16)
    check(QKV_ROPE, 1, 1280, (n_q + 2 * n_kv) * D, 4, 128, torch.float16, False, rope, (2, 2, 2))


# ---- host side ----------------------------------------------------------------------------


def test_prenorm_sources_and_keys():
    """prenorm=False writes the kernels as before (no prologue, no shared x, the old key); the
    pre-norm source peels the first step (its loads before the prologue) with names of its own."""
    src = quant_gemv._source(1, 4, 1, 4, False, PLAIN, "half2", 2)
    assert src == quant_gemv._source(1, 4, 1, 4, False, PLAIN, "half2", 2, False)
    assert "KX" not in src and "_ldsh8" not in src and "residual" not in src
    pre = quant_gemv._source(1, 4, 1, 4, False, PLAIN, "half2", 2, True)
    first_load, prologue = pre.index("q0_0_f = ld_w4"), pre.index("xs_n = cuda.shared.array")
    assert first_load < prologue < pre.index("_ldsh8(xs_n, xc0_0_f)") < pre.index("while w0 < W")
    split = quant_gemv._source(2, 4, 2, 4, True, PLAIN, "factored", 1, True)
    assert "h0_f = min(" in split and "h0_n = _add8(" in split  # no shared name of two types
    with pytest.raises(ValueError, match="pre-norm"):
        quant_gemv._source(4, 4, 1, 4, False, PLAIN, "half2", 1, True)
    n = len(quant_gemv._KERNELS)
    quant_gemv.qgemv_kernel(1, 4, form="half2")  # a registry instance: no new kernel
    assert len(quant_gemv._KERNELS) == n
    assert (1, 4, 1, 4, False, PLAIN, "half2", 2) in quant_gemv._KERNELS


def test_prenorm_checks(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    w = make_weight(8, 256, 4, 32, torch.float16)
    x, r, nw = make_rows(2, 256, torch.float16)
    ro = torch.empty_like(x)
    ok = quant_gemv.supports_prenorm
    assert ok(x, w, r, nw, ro) and ok(x[:1], w, r[:1], nw, ro[:1], kind=GATE_UP)
    x3 = torch.randn(3, 256).half()
    assert not ok(x3, w, torch.randn_like(x3), nw, torch.empty_like(x3))  # M = 3
    assert not ok(x, w, r, nw, r) and not ok(x, w, r, nw, ro, out=x)  # aliasing
    wp = make_weight(8, 256, 4, 32, torch.float16, perm=torch.randperm(256))
    assert not ok(x, wp, r, nw, ro)  # act-order: the kernel reads the rows in order
    odd = dataclasses.replace(w, out_features=7)
    assert ok(x, odd, r, nw, ro) and not ok(x, odd, r, nw, ro, kind=GATE_UP)  # gate_up pairs
    # shared memory: the rows, plus the split-K sums at the one-row int4 default
    K = 12288
    big = make_weight(4, K, 4, 128, torch.float16)
    xb, rb, nb = make_rows(1, K, torch.float16)
    assert quant_gemv.prenorm_smem(1, K, 2, 4) == K * 2 + 4 * 4 * 32 * 4
    assert ok(xb, big, rb, nb, torch.empty_like(xb))
    xb2, rb2, _ = make_rows(2, K, torch.float16)
    assert not ok(xb2, big, rb2, nb, torch.empty_like(xb2))  # 48 KiB of rows


def test_references_compose_the_unfused_ops():
    """The prenorm references: fused_add_rms_norm_ref on copies, then the kind's reference
    (act-order permutation applied after the norm); residual_out may alias residual."""
    from voltserve.kernels.rmsnorm import fused_add_rms_norm_ref

    K = 64
    w = make_weight(24, K, 4, 32, torch.float32, perm=torch.randperm(K))  # qkv: 3 heads of 8
    x, residual, nw = make_rows(2, K, torch.float32)
    xn, r = x.clone(), residual.clone()
    fused_add_rms_norm_ref(xn, r, nw, EPS)
    ro = torch.empty_like(x)
    got = quant_linear.quant_linear_prenorm_ref(x, residual, nw, EPS, w, None, residual_out=ro)
    assert torch.equal(ro, r) and torch.equal(got, quant_linear.quant_linear_ref(xn, w))
    got = quant_linear.quant_gate_up_prenorm_ref(x, residual, nw, EPS, w, residual_out=ro)
    assert torch.equal(got, quant_linear.quant_gate_up_ref(xn, w))
    r2 = residual.clone()
    quant_linear.quant_linear_prenorm_ref(x, r2, nw, EPS, w, residual_out=r2)
    assert torch.equal(r2, r)
    rope = make_rope(2, 1, 1, 8, torch.float32)
    rope2 = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in rope)
    got = quant_linear.quant_qkv_rope_prenorm_ref(
        x, residual, nw, EPS, w, None, *rope, residual_out=ro
    )
    want = quant_gemv.quant_qkv_rope_ref(xn[:, w.perm], w, None, *rope2)
    assert (
        torch.equal(got, want) and torch.equal(rope[2], rope2[2]) and torch.equal(rope[3], rope2[3])
    )


def test_entry_points_on_cpu_and_fallbacks():
    """On CPU the quant_linear entry points are the references (prenorm_folds: 1-2 rows); the
    quant_gemv launchers run the reference for what supports_prenorm refuses (CPU tensors)."""
    from voltserve.kernels.dispatch import KernelDispatch

    ops = KernelDispatch("cpu", torch.float32)
    K, n_q, n_kv, D = 64, 2, 1, 8
    w = make_weight((n_q + 2 * n_kv) * D, K, 8, 16, torch.float32)
    x, residual, nw = make_rows(2, K, torch.float32)
    assert quant_linear.prenorm_folds(x, w, ops) and not quant_linear.prenorm_folds(
        torch.randn(3, K), w, ops
    )
    args = (x, residual, nw, EPS, w, None)
    r1, r2 = torch.empty_like(x), torch.empty_like(x)
    for entry, ref, launcher in (
        (
            quant_linear.quant_linear_prenorm,
            quant_linear.quant_linear_prenorm_ref,
            quant_gemv.quant_gemv_prenorm_cuda,
        ),
        (
            quant_linear.quant_gate_up_silu_prenorm,
            quant_linear.quant_gate_up_prenorm_ref,
            quant_gemv.quant_gemv_gate_up_prenorm_cuda,
        ),
    ):
        want = ref(*args, residual_out=r2)
        assert torch.equal(entry(*args, ops, residual_out=r1), want) and torch.equal(r1, r2)
        assert torch.equal(launcher(*args, residual_out=r1), want) and torch.equal(r1, r2)
    rope = make_rope(2, n_q, n_kv, D, torch.float32)
    ropes = [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in rope) for _ in range(3)]
    want = quant_linear.quant_qkv_rope_prenorm_ref(*args, *ropes[0], residual_out=r2)
    got = quant_linear.quant_qkv_rope_prenorm(*args, ops, *ropes[1], residual_out=r1)
    assert torch.equal(got, want) and torch.equal(r1, r2)
    got = quant_gemv.quant_qkv_rope_prenorm_cuda(*args, *ropes[2], residual_out=r1)
    assert torch.equal(got, want) and all(torch.equal(a[2], ropes[0][2]) for a in ropes[1:])


def test_ldsh8_reads_half2_pairs():
    """The simulator's _ldsh8: the 8 halves at i as 4 words (x0, x1) .. (x6, x7), low half first,
    as half2.ldh8 reads a global row."""
    from voltserve.kernels.half2 import ldh8

    row = np.arange(16, dtype=np.float16) * np.float16(0.5)
    assert quant_gemv._ldsh8(row, 8) == ldh8(row[None, :], (0, 8))
