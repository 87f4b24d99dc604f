"""Group-quantized weights on CPU (kernels/linear/quant_pack.py, quant_linear.py): packing
round-trips the codes exactly, dequantize is codes * scale + offset, and quant_linear is F.linear
with the dequantized weight (the reference model's math), for bits 4 and 8, every group size the
kernels serve, with and without an input permutation. Randomised: seed printed, VOLTSERVE_TEST_SEED
overrides it."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F
from voltserve.kernels.linear.quant_linear import quant_gate_up_silu, quant_linear, quant_linear_ref
from voltserve.kernels.linear.quant_pack import (
    concat_rows,
    dequantize,
    narrow_rows,
    pack_codes,
    pack_group_quant,
    unpack_codes,
)

SEED = int(os.environ.get("VOLTSERVE_TEST_SEED", random.randrange(2**31)))


@pytest.fixture
def gen(request):
    print(f"seed {SEED} (VOLTSERVE_TEST_SEED to repeat) for {request.node.name}")
    return torch.Generator().manual_seed(SEED)


def random_weight(gen, N, K, bits, g, dtype=torch.float32, perm=False):
    codes = torch.randint(0, 2**bits, (N, K), generator=gen, dtype=torch.uint8)
    G = K // g
    scales = torch.rand(N, G, generator=gen) * 0.02 + 0.001
    offsets = -scales * (2 ** (bits - 1)) + torch.randn(N, G, generator=gen) * 0.001
    p = torch.randperm(K, generator=gen) if perm else None
    w = pack_group_quant(codes, scales, offsets, bits, g, dtype, perm=p)
    return w, codes, scales, offsets, p


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K", [32, 48, 200])
def test_codes_round_trip(gen, bits, K):
    codes = torch.randint(0, 2**bits, (5, K), generator=gen, dtype=torch.uint8)
    q = pack_codes(codes, bits)
    assert q.dtype == torch.int32 and q.shape == (5, -(-K // (32 // bits)))
    assert torch.equal(unpack_codes(q, bits, K), codes)


def test_pair_interleaved_word_order():
    # Code e = 2i + h at bit 16h + bits*i: even codes in the low half-word.
    codes = torch.arange(8, dtype=torch.uint8)[None]
    w = int(pack_codes(codes, 4)[0, 0]) & 0xFFFFFFFF
    for e in range(8):
        i, h = divmod(e, 2)
        assert (w >> (16 * h + 4 * i)) & 0xF == e
    codes = torch.tensor([[10, 200, 30, 40]], dtype=torch.uint8)
    w = int(pack_codes(codes, 8)[0, 0]) & 0xFFFFFFFF
    assert [(w >> s) & 0xFF for s in (0, 16, 8, 24)] == [10, 200, 30, 40]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("g", [16, 32, 128, 256])
def test_dequantize_is_codes_times_scale_plus_offset(gen, bits, g):
    N, K = 6, 256
    w, codes, s, o, _ = random_weight(gen, N, K, bits, g)
    ref = codes.float() * s.repeat_interleave(g, 1) + o.repeat_interleave(g, 1)
    assert torch.equal(dequantize(w), ref)
    assert w.qweight.shape == (N, K * bits // 32) and w.scales.shape == (N, K // g)
    assert w.nbytes() == N * K * bits // 8 + 2 * N * (K // g) * 4


def test_per_channel_and_fp16(gen):
    N, K = 4, 96  # g = K, not a power of two
    w, codes, s, o, _ = random_weight(gen, N, K, 4, K, torch.float16)
    assert w.group_shift == 30 and w.scales.dtype == torch.float16
    ref = codes.float() * w.scales.float() + w.offsets.float()
    assert torch.equal(dequantize(w), ref.half())


@pytest.mark.parametrize(
    "bits,g,perm", [(4, 32, False), (4, 128, True), (8, 16, True), (8, 64, False)]
)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_quant_linear_equals_linear_with_dequantized_weight(gen, bits, g, perm, T):
    N, K = 24, 256
    w, codes, s, o, p = random_weight(gen, N, K, bits, g, perm=perm)
    x = torch.randn(T, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    wd = codes.float() * s.repeat_interleave(g, 1) + o.repeat_interleave(g, 1)
    xp = x[:, p] if perm else x
    for ops in (None, _cpu_ops()):
        assert torch.equal(quant_linear(x, w, bias, ops), F.linear(xp, wd, bias))
        assert torch.equal(quant_linear(x, w, None, ops), F.linear(xp, wd))
    gu = quant_gate_up_silu(x, w, bias, _cpu_ops())
    y = F.linear(xp, wd, bias)
    assert torch.equal(gu, F.silu(y[:, : N // 2]) * y[:, N // 2 :])


def _cpu_ops():
    from voltserve.kernels.dispatch import KernelDispatch

    ops = KernelDispatch("cpu", torch.float32)
    assert ops.impl["quant_linear"] == "ref"
    return ops


def test_concat_and_narrow_rows(gen):
    parts = [random_weight(gen, n, 128, 4, 32)[0] for n in (8, 4, 4)]
    merged = concat_rows(parts)
    assert merged.out_features == 16
    assert torch.equal(dequantize(merged), torch.cat([dequantize(p) for p in parts]))
    assert torch.equal(dequantize(narrow_rows(merged, 8, 4)), dequantize(parts[1]))
    other = random_weight(gen, 4, 128, 4, 64)[0]
    with pytest.raises(ValueError, match="group_size"):
        concat_rows([parts[0], other])


def test_bad_input_is_refused_by_name():
    codes = torch.zeros(4, 96, dtype=torch.uint8)
    s = torch.ones(4, 2)
    with pytest.raises(ValueError, match="group_size 48"):
        pack_group_quant(codes, s, s, 4, 48, torch.float32)  # divides, not a power of two
    with pytest.raises(ValueError, match="group_size 64 does not divide"):
        pack_group_quant(codes, s, s, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="bits 3"):
        pack_group_quant(codes, torch.ones(4, 3), torch.ones(4, 3), 3, 32, torch.float32)
    with pytest.raises(ValueError, match="scales"):
        pack_group_quant(codes, torch.ones(4, 2), torch.ones(4, 3), 4, 32, torch.float32)
    with pytest.raises(ValueError, match="below 2\\*\\*4"):
        pack_group_quant(codes + 16, torch.ones(4, 3), torch.ones(4, 3), 4, 32, torch.float32)
    with pytest.raises(ValueError, match="perm"):
        pack_group_quant(
            codes,
            torch.ones(4, 3),
            torch.ones(4, 3),
            4,
            32,
            torch.float32,
            perm=torch.zeros(96).long(),
        )
    w = pack_group_quant(codes, torch.ones(4, 3), torch.ones(4, 3), 4, 32, torch.float32)
    with pytest.raises(ValueError, match="x must be"):
        quant_linear(torch.zeros(2, 95), w)
    assert quant_linear_ref(torch.zeros(2, 96), w).shape == (2, 4)


def test_dispatch_resolves_quant_linear_and_env_switch(monkeypatch):
    from voltserve.kernels import registry
    from voltserve.kernels.dispatch import KernelDispatch

    monkeypatch.delenv("VOLTSERVE_QUANT_KERNELS", raising=False)
    assert KernelDispatch("cuda", torch.float16).impl["quant_linear"] == "cuda"  # no device touched
    monkeypatch.setenv("VOLTSERVE_QUANT_KERNELS", "0")
    assert KernelDispatch("cuda", torch.float16).impl["quant_linear"] == "ref"
    assert registry.ops()["quant_linear"].capturable_ref  # dequantize + F.linear never syncs


def test_scratch_is_reused_and_sized_once():
    from voltserve.kernels.linear.quant_linear import QuantScratch

    s = QuantScratch()
    a = s.get(4, 8, torch.float32, torch.device("cpu"))
    b = s.get(2, 8, torch.float32, torch.device("cpu"))
    assert a.shape == (4, 8) and b.shape == (2, 8) and a.data_ptr() == b.data_ptr()
    c = s.get(8, 8, torch.float32, torch.device("cpu"))  # grows (outside a capture)
    assert c.numel() == 64
