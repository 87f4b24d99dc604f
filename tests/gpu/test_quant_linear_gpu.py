"""Quantized linears on a real GPU (kernels/linear/quant_linear.py and the kernels it routes to: the
fused dequantize-GEMV, the tensor-core GEMM, dequantize + cuBLAS) against the reference (F.linear
with the dequantized weight, in fp32) at Llama-3-8B and Qwen2.5-7B shapes, every row count from
batch-1 decode to an 8K prefill chunk, poisoned outputs, bias, input permutation, int4 / int8
and group sizes 16 / 32 / 128 / K; the fused gate_up + SiLU; CUDA-graph capture and replay."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
# (K, N): Llama-3-8B qkv, o_proj, gate_up, down; Qwen2.5-7B qkv (with bias), o_proj, gate_up,
# down. (The safetensors formats keep lm_head fp16; a GGUF Q6_K / Q8_0 one at vocabulary sizes
# is in test_launch_geometry_gpu.py.)
LLAMA = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
QWEN = [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584)]
ROWS = [1, 3, 8, 17, 64, 255, 256, 2048, 8192]


@functools.cache
def weight(K: int, N: int, bits: int, g: int, perm: bool = False, dtype=torch.float16):
    from voltserve.kernels.linear.quant_pack import pack_group_quant

    gen = torch.Generator(device=DEV).manual_seed(K * 31 + N + bits * 7 + g)
    codes = torch.randint(0, 2**bits, (N, K), generator=gen, device=DEV, dtype=torch.uint8)
    G = K // g
    # weights ~ +-0.02 (a trained 8B layer's range): s * 2**bits / 2 ~ 0.02
    s = (torch.rand(N, G, generator=gen, device=DEV) + 0.5) * (0.04 / 2**bits)
    o = -s * 2 ** (bits - 1) + torch.randn(N, G, generator=gen, device=DEV) * 0.002
    p = torch.randperm(K, generator=gen, device=DEV) if perm else None
    return pack_group_quant(codes, s, o, bits, g, dtype, perm=p)


def ops():
    from voltserve.kernels.dispatch import KernelDispatch

    o = KernelDispatch(DEV, torch.float16, force_ref=False)
    assert o.impl["quant_linear"] == "cuda"
    return o


def check(out: torch.Tensor, x: torch.Tensor, w, bias) -> None:
    """out against the fp32 product with the (unrounded) dequantized weight: no worse than the
    reference model's own fp16 F.linear by more than a few fp16 ulps of the output's scale."""
    from voltserve.kernels.linear.quant_pack import dequantize

    assert not torch.isnan(out).any(), "poisoned (NaN) outputs left"
    xp = x if w.perm is None else x[:, w.perm]
    b32 = None if bias is None else bias.float()
    ref32 = F.linear(xp.float(), dequantize(w, torch.float32), b32)
    ref16 = F.linear(xp, dequantize(w, torch.float16), bias).float()
    scale = ref32.abs().max().item()
    err = (out.float() - ref32).abs().max().item()
    err16 = (ref16 - ref32).abs().max().item()
    assert err <= err16 + scale * 2**-9 + 1e-3, (err, err16, scale)


def run_linear(K, N, rows, bits=4, g=128, bias=False, perm=False):
    from voltserve.kernels.linear.quant_linear import quant_linear

    w = weight(K, N, bits, g, perm)
    x = torch.randn(rows, K, device=DEV, dtype=torch.float16)
    b = torch.randn(N, device=DEV, dtype=torch.float16) if bias else None
    out = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.float16)
    quant_linear(x, w, b, ops(), out=out)
    torch.cuda.synchronize()
    check(out, x, w, b)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("K,N", LLAMA)
def test_llama_awq_int4_g128(K, N, rows):
    run_linear(K, N, rows)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("K,N", QWEN)
def test_qwen_int4_g128(K, N, rows):
    run_linear(K, N, rows, bias=(N == 4608))


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 256, 2048])
@pytest.mark.parametrize(
    "bits,g",
    [(4, 32), (4, 16), (8, 32), (8, 16), (8, 128), (4, 4096)],  # 4096 = K: per-channel
)
def test_group_sizes_and_int8(bits, g, rows):
    run_linear(4096, 4096, rows, bits=bits, g=g, bias=rows % 2 == 1)


@pytest.mark.parametrize("rows", [1, 8, 17, 255, 2048])
def test_act_order_permutation(rows):
    run_linear(4096, 6144, rows, bits=4, g=128, perm=True)
    run_linear(3584, 3584, rows, bits=8, g=32, perm=True)


def test_paths_by_row_count():
    from voltserve.kernels.linear.quant_linear import DEQUANT, GEMV, TC, quant_path

    w = weight(4096, 4096, 4, 128)
    paths = [quant_path(r, torch.float16, w) for r in (1, 4, 5, 8, 9, 64, 65)]
    assert paths == [GEMV, GEMV, TC, TC, TC, TC, DEQUANT]
    w32 = weight(4096, 4096, 4, 128, dtype=torch.float32)  # an fp32 run's weight
    assert quant_path(8, torch.float32, w32) == GEMV  # no tensor-core GEMM for fp32: the GEMV
    assert quant_path(64, torch.float32, w32) == DEQUANT


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64])
@pytest.mark.parametrize("K,N", [(4096, 28672), (3584, 37888)])
def test_gate_up_silu(K, N, rows):
    from voltserve.kernels.elementwise.activation import silu_and_mul_ref
    from voltserve.kernels.linear.quant_linear import quant_gate_up_silu
    from voltserve.kernels.linear.quant_pack import dequantize

    w = weight(K, N, 4, 128)
    x = torch.randn(rows, K, device=DEV, dtype=torch.float16) * 2
    out = quant_gate_up_silu(x, w, None, ops())
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    y = F.linear(x.float(), dequantize(w, torch.float32)).half()  # the linear's stored product
    ref = silu_and_mul_ref(y).float()
    err = (out.float() - ref).abs().max().item()
    assert err <= ref.abs().max().item() * 2**-8 + 2e-3, err


def test_gemv_fp32_runs():
    from voltserve.kernels.linear.quant_gemv import quant_gemv_cuda, supports
    from voltserve.kernels.linear.quant_pack import dequantize, pack_group_quant

    gen = torch.Generator(device=DEV).manual_seed(5)
    K, N = 4096, 1024
    codes = torch.randint(0, 16, (N, K), generator=gen, device=DEV, dtype=torch.uint8)
    s = torch.rand(N, K // 64, generator=gen, device=DEV) * 0.01
    w = pack_group_quant(codes, s, -8 * s, 4, 64, torch.float32)
    x = torch.randn(3, K, device=DEV)
    assert supports(x, w)
    out = quant_gemv_cuda(x, w)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, F.linear(x, dequantize(w)), atol=1e-3, rtol=1e-3)


def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.mark.parametrize("rows", [1, 8, 64, 256])
def test_cuda_graph_capture_and_replay(rows):
    from voltserve.kernels.elementwise.activation import silu_and_mul_ref
    from voltserve.kernels.linear.quant_linear import quant_gate_up_silu, quant_linear
    from voltserve.kernels.linear.quant_pack import dequantize

    o = ops()
    w = weight(4096, 6144, 4, 128)
    wg = weight(4096, 28672, 4, 128)
    x = torch.randn(rows, 4096, device=DEV, dtype=torch.float16)
    out = torch.empty(rows, 6144, device=DEV, dtype=torch.float16)
    res = {}

    def step():
        quant_linear(x, w, None, o, out=out)
        res["h"] = quant_gate_up_silu(x, wg, None, o)

    g = _capture(step)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        res["h"].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(out, x, w, None)
        y = F.linear(x.float(), dequantize(wg, torch.float32)).half()
        ref = silu_and_mul_ref(y).float()
        err = (res["h"].float() - ref).abs().max().item()
        assert err <= ref.abs().max().item() * 2**-8 + 2e-3, err


def test_dequantize_kernel_matches_reference():
    from voltserve.kernels.linear.quant_dequant import dequantize_into, supports
    from voltserve.kernels.linear.quant_pack import dequantize

    for bits, g in ((4, 128), (4, 16), (8, 32)):
        w = weight(4096, 4096, bits, g)
        out = torch.full((4096, 4096), float("nan"), device=DEV, dtype=torch.float16)
        assert supports(w, out)
        dequantize_into(w, out)
        torch.cuda.synchronize()
        ref = dequantize(w)
        assert not torch.isnan(out).any()
        # The same fp32 value rounded once; an FMA may round differently: 1 ulp at most.
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=2**-10)


def test_tc_split_k_matches_unsplit():
    from voltserve.kernels.linear.quant_gemm_tc import quant_gemm_tc_cuda

    w = weight(14336, 4096, 4, 128)
    x = torch.randn(17, 14336, device=DEV, dtype=torch.float16)
    b = torch.randn(4096, device=DEV, dtype=torch.float16)
    one = quant_gemm_tc_cuda(x, w, b, split=1)
    four = quant_gemm_tc_cuda(x, w, b, split=4)
    torch.cuda.synchronize()
    check(one, x, w, b)
    check(four, x, w, b)


@pytest.mark.parametrize("rows", [9, 16, 17, 32, 33, 64, 65, 129, 256])
@pytest.mark.parametrize("bits,g", [(4, 128), (4, 16), (8, 32)])
def test_tc_every_tile_config(bits, g, rows):
    """The tensor-core GEMM at the row counts that pick each default tile config (16, 32, 64 and
    128 rows; full and partial row tiles, two 128-row tiles), down_proj's K."""
    from voltserve.kernels.linear.quant_gemm_tc import quant_gemm_tc_cuda

    w = weight(14336, 4096, bits, g)
    x = torch.randn(rows, 14336, device=DEV, dtype=torch.float16)
    b = torch.randn(4096, device=DEV, dtype=torch.float16) if rows % 2 else None
    out = torch.full((rows, 4096), float("nan"), device=DEV, dtype=torch.float16)
    quant_gemm_tc_cuda(x, w, b, out)
    torch.cuda.synchronize()
    check(out, x, w, b)


def _candidates():
    from voltserve.kernels.linear.quant_gemm_tc import CANDIDATES

    return [c for cs in CANDIDATES.values() for c in cs]


@pytest.mark.parametrize(
    "cfg",
    [(1, 4, 1, 1, 128), (2, 2, 2, 2, 128), (4, 2, 2, 2, 64), *_candidates()],
    ids=["w11_bk128", "w22_bk128", "8warps_w22", *(c.name for c in _candidates())],
)
def test_tc_other_tile_configs(cfg):
    """Tile configs the defaults do not use: K steps of 128 (K = 4160 ends in a half-filled step,
    the K tail) and 2 x 2 fragments a warp; a partial row tile, with and without split-K."""
    from voltserve.kernels.linear.quant_gemm_tc import TileConfig, quant_gemm_tc_cuda

    cfg = cfg if isinstance(cfg, TileConfig) else TileConfig(*cfg)
    w = weight(4160, 4096, 4, 64)
    x = torch.randn(cfg.bm - 3, 4160, device=DEV, dtype=torch.float16)
    b = torch.randn(4096, device=DEV, dtype=torch.float16)
    one = quant_gemm_tc_cuda(x, w, b, split=1, cfg=cfg)
    three = quant_gemm_tc_cuda(x, w, b, split=3, cfg=cfg)
    torch.cuda.synchronize()
    check(one, x, w, b)
    check(three, x, w, b)


def check_qkv_rope(y, x, w, b, args, kr, vr) -> None:
    """y (a fused q/k/v projection + rotary + cache write) and the caches in args = (positions,
    cos_sin, k_cache, v_cache, slots, n_q, n_kv) against quant_qkv_rope_ref run on kr, vr (fp32
    copies of the caches as they were before): the dequantized product in fp32, rounded to
    fp16, rotated, cached. The caches start random, so comparing them whole also checks that
    only live slots were written."""
    from voltserve.kernels.linear.quant_gemv import quant_qkv_rope_ref

    pos, cache, kc, vc, slots, n_q, n_kv = args
    bf = None if b is None else b.float()
    ref = quant_qkv_rope_ref(x.float(), w, bf, pos, cache, kr, vr, slots, n_q, n_kv)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any()
    tol = ref.abs().max().item() * 2**-8 + 2e-3
    assert (y.float() - ref).abs().max().item() <= tol
    assert (kc.float() - kr).abs().max().item() <= tol
    assert (vc.float() - vr).abs().max().item() <= tol


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("K,n_q,n_kv,bias", [(4096, 32, 8, False), (3584, 28, 4, True)])
def test_qkv_rope_fused(K, n_q, n_kv, bias, rows):
    """quant_qkv_rope (fused for <= 8 rows, quant_linear + rotary_and_cache beyond) against the
    reference: the dequantized product in fp32, rounded to fp16, rotated, cached."""
    from voltserve.kernels.attention.rotary import build_cos_sin_cache
    from voltserve.kernels.linear.quant_linear import quant_qkv_rope

    D, bs, blocks = 128, 16, 8
    N = (n_q + 2 * n_kv) * D
    w = weight(K, N, 4, 128)
    x = torch.randn(rows, K, device=DEV, dtype=torch.float16)
    b = torch.randn(N, device=DEV, dtype=torch.float16) if bias else None
    pos = torch.randint(0, 4096, (rows,), device=DEV)
    slots = torch.randperm(blocks * bs, device=DEV)[:rows]
    if rows > 1:
        slots[1] = -1
    cache = build_cos_sin_cache(D, 4096, 500000.0, None).to(DEV)
    # Caches start random: comparing them whole also checks that only live slots are written.
    kc = torch.randn(blocks, n_kv, bs, D, device=DEV).half()
    vc = torch.randn_like(kc)
    kr, vr = kc.float(), vc.float()
    args = (pos, cache, kc, vc, slots, n_q, n_kv)
    check_qkv_rope(quant_qkv_rope(x, w, b, ops(), *args), x, w, b, args, kr, vr)


@pytest.mark.parametrize("form", ["factored", "half2"])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "K,N,bits,g",
    [(4096, 6144, 4, 128), (14336, 4096, 4, 128), (4096, 4096, 4, 16), (4096, 4096, 8, 32)],
)
def test_gemv_forms(K, N, bits, g, rows, form):
    """The factored and half2 GEMVs forced at every row count against the reference (half2
    serves int4 with one group per chunk; form_for gives the factored form elsewhere), and
    through quant_linear, quant_gate_up_silu and quant_qkv_rope where the form is the default
    (half2: every row count; factored: 1-2): subnormal fp32 code floats (factored) and fp16 subnormals (half2) need
    instructions that keep them. check()'s bound (a few fp16 ulps of the output's scale past
    fp16 F.linear's own error) holds for half2's fp16 runs: 16 products per half rounded to
    fp16 add ~2**-11 of a run's magnitude each, and K / 16 such runs average out far below
    2**-9 of the output scale (quant_gemv's module doc)."""
    from voltserve.kernels.linear.quant_gemv import form_for, quant_gemv_cuda

    w = weight(K, N, bits, g)
    x = torch.randn(rows, K, device=DEV, dtype=torch.float16)
    out = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.float16)
    quant_gemv_cuda(x, w, None, out, form=form)
    torch.cuda.synchronize()
    check(out, x, w, None)
    half2_ok = bits == 4 and g >= 32
    assert form_for(rows, torch.float16, bits, not half2_ok and bits == 4) == (
        "half2" if half2_ok else "factored" if rows <= 2 else "weight"
    )
    if form == "half2" and not half2_ok:
        return  # the same launch as the factored case
    run_linear(K, N, rows, bits=bits, g=g, bias=True)
    if (K, N, bits) == (4096, 6144, 4) and rows <= 4:
        test_gate_up_silu(4096, 28672, rows)
        test_qkv_rope_fused(4096, 32, 8, True, rows)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("xs", ["huge", "tiny"])
@pytest.mark.parametrize("K,N", [(4096, 6144), (14336, 4096)])
def test_half2_x_range(K, N, rows, xs):
    """The half2 GEMV at fp16's extremes against its worst-case bound (quant_gemv's module doc):
    x with 64 elements near +-65504 (the 2**-8 scaling keeps every fp16 run finite) or all x
    ~ 1e-4 (scaled x and products are fp16 subnormals: 2**-17 absolute per rounding). Bound:
    2**-7 * sum_k |x_k| (8 |s| + |o + 8 s|) for the runs (|c - 8| <= 8), 2**-17 * sum_k (|s| +
    |o + 8 s|) for subnormal rounding, then the fp16 output's rounding (2**-11 |y| + 2**-25)."""
    from voltserve.kernels.linear.quant_gemv import quant_gemv_cuda
    from voltserve.kernels.linear.quant_pack import dequantize

    w = weight(K, N, 4, 128)
    gen = torch.Generator(device=DEV).manual_seed(K + rows)
    x = torch.randn(rows, K, device=DEV, generator=gen)
    if xs == "huge":
        idx = torch.randint(0, K, (rows, 64), device=DEV, generator=gen)
        x.scatter_(1, idx, torch.sign(x.gather(1, idx)) * 65504)
    else:
        x = x * 1e-4
    x = x.half()
    out = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.float16)
    quant_gemv_cuda(x, w, None, out, form="half2")
    ref = F.linear(x.double(), dequantize(w, torch.float32).double())
    s = w.scales.double().repeat_interleave(128, dim=1)
    o = (w.offsets.double().repeat_interleave(128, dim=1) + 8 * s).abs()
    bound = F.linear(x.double().abs(), 8 * s.abs() + o) * 2.0**-7 * 1.01
    bound += (s.abs() + o).sum(dim=1) * 2.0**-17 + ref.abs() * 2.0**-11 + 2.0**-25
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "poisoned, inf or NaN outputs"
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), (err / bound).max().item()


@pytest.mark.parametrize("ks", [2, 4])
@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("K,N", LLAMA)
def test_gemv_split_k(K, N, rows, ks):
    """Split-K (the tile's KS: KS warps of a block on the same rows, each a 1/KS share of K,
    summed through shared memory in warp order) at the Llama-3-8B shapes: plain at the default
    (R, U) of tile_for and at R = 2 (every launch half2, int4 g128), against the reference and
    within fp32 summation order (plus one fp16 ulp of the output) of KS = 1; gate_up fused
    (gate_up's shape) and qkv_rope (qkv's shape, 32 q and 8 kv heads of 128) the same way."""
    from voltserve.kernels.attention.rotary import build_cos_sin_cache
    from voltserve.kernels.elementwise.activation import silu_and_mul_ref
    from voltserve.kernels.linear.quant_gemv import (
        GATE_UP,
        quant_gemv_cuda,
        quant_gemv_gate_up_cuda,
        quant_qkv_rope_cuda,
        tile_for,
        variant_for,
    )
    from voltserve.kernels.linear.quant_pack import dequantize

    w = weight(K, N, 4, 128)
    x = torch.randn(rows, K, device=DEV, dtype=torch.float16)
    b = torch.randn(N, device=DEV, dtype=torch.float16) if rows == 2 else None
    R, U = tile_for(variant_for(rows), 4)
    for tile in ((R, U), (2, 2)):
        one = quant_gemv_cuda(x, w, b, tile=(*tile, 1), form="half2")
        out = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.float16)
        quant_gemv_cuda(x, w, b, out, tile=(*tile, ks), form="half2")
        torch.cuda.synchronize()
        check(out, x, w, b)
        torch.testing.assert_close(out, one, atol=1e-3, rtol=2**-10)
    if N == 28672:
        R, U = tile_for(variant_for(rows), 4, GATE_UP)
        one = quant_gemv_gate_up_cuda(x, w, tile=(R, U, 1), form="half2")
        h = quant_gemv_gate_up_cuda(x, w, tile=(R, U, ks), form="half2")
        torch.cuda.synchronize()
        assert not torch.isnan(h).any()
        y = F.linear(x.float(), dequantize(w, torch.float32)).half()
        ref = silu_and_mul_ref(y).float()
        err = (h.float() - ref).abs().max().item()
        assert err <= ref.abs().max().item() * 2**-8 + 2e-3, err
        torch.testing.assert_close(h, one, atol=2e-3, rtol=2**-9)
    if N == 6144:
        n_q, n_kv, D, bs, blocks = 32, 8, 128, 16, 8
        pos = torch.randint(0, 4096, (rows,), device=DEV)
        slots = torch.randperm(blocks * bs, device=DEV)[:rows]
        cache = build_cos_sin_cache(D, 4096, 500000.0, None).to(DEV)
        kc = torch.randn(blocks, n_kv, bs, D, device=DEV).half()
        vc = torch.randn_like(kc)
        kr, vr = kc.float(), vc.float()
        args = (pos, cache, kc, vc, slots, n_q, n_kv)
        y = quant_qkv_rope_cuda(x, w, b, *args, form="half2", tile=(2, 2, ks))
        check_qkv_rope(y, x, w, b, args, kr, vr)
