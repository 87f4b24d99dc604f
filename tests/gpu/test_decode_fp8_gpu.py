"""Decode attention over a one-byte (fp8) KV cache (attention/decode_fp8.py) on a real GPU at
contexts of 4K, 32K and 128K tokens, against the fp32 reference (attention/ref.py) over the
pages dequantized here from torch's float8 types (not by the code under test).

Error bound as tests/gpu/test_attention_gpu.py's: |out - ref| <= 2e-3 + 5e-3 * |ref|: the kernel
accumulates in fp32 from exactly the dequantized values (e4m3's 2^8 and scales are powers of two
or one rounding of an fp32 product away), so the bound leaves room only for the sum order and the
fp16 output. Slots past each context hold codes that would show if read (e5m2 NaN; e4m3 448);
outputs are NaN before each launch.
"""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.attention.ref import paged_decode_attention_ref

from tests.gpu.paged_cache import BLOCK, pages_for, shuffled_tables
from tests.kv_rounding import codes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATOL, RTOL = 2e-3, 5e-3
CONTEXTS = [4096, 32768, 131072]
TORCH_FP8 = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
PAST_END = {"fp8_e5m2": 0x7F, "fp8_e4m3": 0x7E}
SCALES = {"fp8_e5m2": (1.0, 1.0), "fp8_e4m3": (0.0625, 0.75)}  # e4m3: k_scale, v_scale


def fp8_cache(seq_lens, kvh, D, fmt, gen, width=None):
    """(uint8 K, V caches, tables, fp32 dequantized K, V): N(0, 2) values in shuffled blocks."""
    k_scale, v_scale = SCALES[fmt]
    shape = (pages_for(seq_lens), kvh, BLOCK, D)
    k = codes(2 * torch.randn(shape, generator=gen, device="cuda"), fmt, k_scale)
    v = codes(2 * torch.randn(shape, generator=gen, device="cuda"), fmt, v_scale)
    tables = shuffled_tables(seq_lens, k, v, PAST_END[fmt], gen, width)
    k_ref = k.view(TORCH_FP8[fmt]).float() * k_scale
    v_ref = v.view(TORCH_FP8[fmt]).float() * v_scale
    return k, v, tables, k_ref, v_ref


def check(out, ref):
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("online", [None, True, False])  # the launcher's choice, each core
@pytest.mark.parametrize("fmt", sorted(TORCH_FP8))
@pytest.mark.parametrize("H,kvh,D", [(32, 8, 128), (8, 2, 64), (28, 4, 128)])
def test_fp8_decode_long_contexts(H, kvh, D, fmt, online):
    """Batch 1 at each context (the issue's shapes: the Llama-3-8B heads; 64 dims; 7 heads per
    KV head), then the three together in one ragged batch with a padding row."""
    from voltserve.kernels.attention.decode_fp8 import paged_decode_attention_fp8_cuda

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    k_scale, v_scale = SCALES[fmt]
    for seq_lens in [[c] for c in CONTEXTS] + [[*CONTEXTS, 0, 17]]:
        k, v, tables, k_ref, v_ref = fp8_cache(seq_lens, kvh, D, fmt, gen)
        q = torch.randn((len(seq_lens), H, D), generator=gen, device="cuda").half()
        sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        scale = D**-0.5
        ref = paged_decode_attention_ref(q.float(), k_ref, v_ref, tables, sl, scale)
        ref[sl == 0] = 0
        out = torch.full_like(q, float("nan"))
        paged_decode_attention_fp8_cuda(
            q, k, v, tables, sl, scale, out, fmt=fmt, k_scale=k_scale, v_scale=v_scale,
            online=online,
        )  # fmt: skip
        torch.cuda.synchronize()
        check(out, ref)


@pytest.mark.parametrize("fmt", sorted(TORCH_FP8))
def test_fp8_decode_cuda_graph_replay_with_new_seq_lens(fmt):
    """Captured once under a 128K bound at batch 4 (the grid fixed by the bound), replayed with
    other lengths (a 0 row, 1 token, every partition count up to the bound)."""
    from voltserve.kernels.attention.decode_fp8 import paged_decode_attention_fp8_cuda

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    B, kvh, H, D, bound = 4, 8, 32, 128, 131072
    k_scale, v_scale = SCALES[fmt]
    k, v, tables, k_ref, v_ref = fp8_cache([bound] * B, kvh, D, fmt, gen)
    q = torch.randn((B, H, D), generator=gen, device="cuda").half()
    sl = torch.ones(B, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))

    def step():
        paged_decode_attention_fp8_cuda(
            q, k, v, tables, sl, D**-0.5, out, fmt=fmt, k_scale=k_scale, v_scale=v_scale,
            max_seq_len=bound,
        )  # fmt: skip

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # the compile and the merge counters, outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([0, 1, 4095, 131072], [17, 65536, 32769, 2], [131072] * 4):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention_ref(q.float(), k_ref, v_ref, tables, sl, D**-0.5)
        ref[sl == 0] = 0
        check(out, ref)
