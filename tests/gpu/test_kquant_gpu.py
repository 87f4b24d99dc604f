"""GGUF K-quant linears on a real GPU (kernels/linear/kquant_linear.py: the GEMV over the blocks
as stored up to 8 rows, dequantize + cuBLAS above) against the reference built from gguf's own
dequantizer (fp64 products of its fp32 weights) at Llama-3-8B shapes: Q4_K and Q6_K, a merged
qkv of Q4_K q/k beside a Q6_K v, the 128,256-row Q6_K lm_head; every split-K; CUDA-graph capture
and replay. Blocks are packed from random weights by load_tests/gguf_pack.py (llama.cpp's
layouts). Skipped without CUDA."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from voltserve.kernels.linear.kquant_pack import make_kquant_weight, segments_of

from load_tests.gguf_pack import quantize_k
from tests.gpu.linear_ops import Ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
# (K, [(rows, type) per shard]): qkv (Q4_K_M's first layers), gate_up, down, the lm_head
SHAPES = [
    (4096, [(4096, "Q4_K"), (1024, "Q4_K"), (1024, "Q6_K")]),
    (4096, [(28672, "Q4_K")]),
    (14336, [(4096, "Q4_K")]),
    (14336, [(4096, "Q6_K")]),
    (4096, [(128256, "Q6_K")]),
]
ROWS = [1, 3, 8, 17, 256]


@functools.cache
def weight(K: int, shards: tuple):
    """(segments, the gguf package's fp32 dequantization of every shard, on the GPU)."""
    gen = torch.Generator(device=DEV).manual_seed(K + sum(n for n, _ in shards))
    parts, refs = [], []
    for n, kind in shards:
        raw = quantize_k(torch.randn(n, K, generator=gen, device=DEV) * 0.02, kind)
        parts.append(make_kquant_weight(kind, raw, K))
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        ref = np.asarray(gguf.quants.dequantize(raw.cpu().numpy(), qtype)).reshape(n, K)
        refs.append(torch.from_numpy(ref).to(DEV))
    return segments_of(parts), torch.cat(refs)


def reference(x, wd, bias=None):
    return F.linear(x.double(), wd.double(), None if bias is None else bias.double())


def close(y, ref, x, wd):
    """fp16 output against the fp64 product: the kernels' fp16 runs (<= 2**-7 of sum |x w| in
    the worst case, ~2**-11 typically) and the output's rounding."""
    terms = x.double().abs() @ wd.double().abs().T
    err = (y.double() - ref).abs()
    assert (err <= 2.0**-8 * terms + 2.0**-10 * ref.abs()).all(), err.max().item()


@pytest.mark.parametrize("K,shards", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("rows", ROWS)
def test_kquant_linear_matches_gguf_reference(K, shards, rows):
    from voltserve.kernels.linear.kquant_linear import kquant_linear

    segs, wd = weight(K, tuple(shards))
    gen = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, K, generator=gen, device=DEV, dtype=torch.float16)
    bias = torch.randn(wd.shape[0], generator=gen, device=DEV, dtype=torch.float16)
    y = kquant_linear(x, segs, bias, Ops())
    assert y.shape == (rows, wd.shape[0]) and y.dtype == torch.float16
    close(y, reference(x, wd, bias), x, wd)


@pytest.mark.parametrize("R,KS", [(1, 1), (2, 1), (2, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize("rows", [1, 8])
def test_every_tile_and_split(R, KS, rows):
    from voltserve.kernels.linear.kquant_linear import kquant_gemv_cuda

    segs, wd = weight(4096, ((4096, "Q4_K"), (1024, "Q4_K"), (1024, "Q6_K")))
    x = torch.randn(rows, 4096, device=DEV, dtype=torch.float16)
    y = kquant_gemv_cuda(x, segs, tile=(R, KS))
    close(y, reference(x, wd), x, wd)


def test_cuda_graph_replays_the_gemv_and_the_dequantize_path():
    from voltserve.kernels.linear.kquant_linear import kquant_linear
    from voltserve.kernels.linear.quant_linear import reserve_scratch

    segs, wd = weight(14336, ((4096, "Q4_K"),))
    ops = Ops()
    reserve_scratch(ops, wd.numel())
    for rows in (1, 64):
        x = torch.randn(rows, 14336, device=DEV, dtype=torch.float16)
        kquant_linear(x, segs, None, ops)  # warm: kernels built before capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = kquant_linear(x, segs, None, ops)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        close(y, reference(x, wd), x, wd)
