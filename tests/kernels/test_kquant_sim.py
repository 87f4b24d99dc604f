"""The GGUF K-quant kernels (kernels/linear/kquant_gemv.py, kquant_dequant.py) in the CUDA
simulator against a torch reference built from the gguf package's own dequantizer
(gguf.quants.dequantize: it has no quantizer for the K-quants, so the blocks are random bytes,
every one a valid block, with d and dmin drawn in a model's range). Outputs are NaN-poisoned
first; launched with the production grids and blocks of 4 warps, at tiny shapes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from voltserve.kernels.linear import kquant_dequant, kquant_gemv
from voltserve.kernels.linear.gguf_blocks import BLOCK_TYPES
from voltserve.kernels.linear.kquant_pack import (
    dequantize_kquant,
    make_kquant_weight,
    segments_of,
)
from voltserve.kernels.runtime.numba_common import SIM, launch

pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")


def random_blocks(kind: str, N: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [N, K / 256 * nbytes]: random codes and scale bytes, positive fp16 d (and dmin)."""
    bt = BLOCK_TYPES[kind]
    nb = K // 256
    raw = torch.randint(0, 256, (N, nb, bt.nbytes), generator=gen, dtype=torch.uint8)

    def f16(lo: float, hi: float) -> torch.Tensor:
        v = (torch.rand(N, nb, generator=gen) * (hi - lo) + lo).half()
        return v.view(torch.uint8).view(N, nb, 2)

    if kind == "Q6_K":
        raw[..., 208:210] = f16(1e-4, 2e-3)
    else:
        raw[..., 0:2] = f16(1e-4, 2e-3)
        raw[..., 2:4] = f16(0.0, 2e-3)
    return raw.view(N, -1)


def gguf_reference(kind: str, raw: torch.Tensor, K: int) -> torch.Tensor:
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw.numpy(), qtype))).reshape(-1, K)


def gemv(w, x: torch.Tensor, bias, R: int, KS: int) -> torch.Tensor:
    M, N = x.shape[0], w.out_features
    out = torch.full((M, N), float("nan"), dtype=torch.float16)
    b = out[0] if bias is None else bias
    args = [x, w.words(), b, out, bias is not None]
    if w.kind == "Q6_K":
        args[2:2] = [w.scales, w.d]
    launch(
        kquant_gemv.kquant_kernel(w.kind, M, R, KS),
        kquant_gemv.grid_for(N, R, KS),
        kquant_gemv.THREADS,
        tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in args),
    )
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    return out


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_blocks_are_kept_and_read_as_gguf_reads_them(kind: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = random_blocks(kind, 3, 512, gen)
    w = make_kquant_weight(kind, raw, 512)
    assert torch.equal(w.raw_bytes(), raw) and w.nbytes() == raw.numel()
    assert torch.equal(dequantize_kquant(w), gguf_reference(kind, raw, 512))


# (kind, M, N, K, R, KS, bias). K = 512: two blocks, one step with six lanes' blocks past the
# end; K = 2304: nine blocks, two steps, the second split off to warp 1 of each group at KS = 2.
# N = 3 at R = 2: the second group's second row past N (computed, not written).
GEMV_CASES = [
    ("Q4_K", 1, 3, 512, 2, 1, True),
    ("Q4_K", 3, 3, 2304, 2, 2, False),  # the 4-input variant, input 3 clamped to 2
    ("Q6_K", 1, 3, 2304, 2, 2, True),
    ("Q6_K", 3, 3, 512, 1, 1, False),
]


@pytest.mark.parametrize("kind,M,N,K,R,KS,bias", GEMV_CASES)
def test_gemv_matches_gguf_reference(kind, M, N, K, R, KS, bias, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = random_blocks(kind, N, K, gen)
    w = make_kquant_weight(kind, raw, K)
    x = torch.randn(M, K, generator=gen).half()
    b = torch.randn(N, generator=gen).half() if bias else None
    out = gemv(w, x, b, R, KS)
    wd = gguf_reference(kind, raw, K).double()
    ref = x.double() @ wd.T + (b.double() if bias else 0)
    # fp16 runs of 16 (Q4_K) / 8 (Q6_K) products a half, each rounding by <= 2**-11 of the run's
    # magnitude (quant_gemv's half2 bound), then fp32 sums and one rounding to fp16
    terms = x.double().abs() @ wd.abs().T
    bound = 2.0**-7 * terms + 2.0**-11 * ref.abs() + 1e-6
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("kind,limit", [("Q4_K", None), ("Q6_K", 2)])
def test_dequant_kernel_matches_gguf_reference(kind: str, limit, seed: int) -> None:
    """limit 2: the 3 rows folded over y and z, one slice of blocks past the end."""
    gen = torch.Generator().manual_seed(seed)
    N, K = 3, 512
    raw = random_blocks(kind, N, K, gen)
    w = make_kquant_weight(kind, raw, K)
    out = torch.full((N, K), float("nan"), dtype=torch.float16)
    args = (w.words(), out) if kind == "Q4_K" else (w.words(), w.scales, w.d, out)
    kernel = getattr(kquant_dequant, f"dequant_{kind.lower()}_kernel")
    launch(
        kernel,
        kquant_dequant.grid_for(w, limit),
        kquant_dequant.THREADS,
        tuple(a.numpy() for a in args),
    )
    assert not torch.isnan(out).any(), "kernel left poisoned (NaN) outputs"
    ref = gguf_reference(kind, raw, K)
    # ggml's fp32 value (its products grouped alike up to one fused rounding), rounded to fp16
    assert ((out.float() - ref).abs() <= 2.0**-10 * ref.abs() + 2.0**-24).all()


def test_merged_shards_keep_their_types(seed: int) -> None:
    """q/k Q4_K then v Q6_K: one segment each type, rows in order, bytes unchanged."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        make_kquant_weight(kind, random_blocks(kind, n, 256, gen), 256)
        for kind, n in (("Q4_K", 4), ("Q4_K", 2), ("Q6_K", 2))
    )
    segs = segments_of([q, k, v])
    assert [(s.start, s.weight.kind, s.weight.out_features) for s in segs] == [
        (0, "Q4_K", 6),
        (6, "Q6_K", 2),
    ]
    assert torch.equal(segs[0].weight.blocks, torch.cat([q.blocks, k.blocks]))
    assert sum(s.weight.nbytes() for s in segs) == q.nbytes() + k.nbytes() + v.nbytes()
