"""Which prefill attention kernel the engine runs (no GPU: resolving and routing launch nothing).

KernelDispatch on CUDA with fp16 resolves `paged_attention` to prefill_attention_fa's entry,
which sends head dims 64, 128 and 256 with up to 64 query heads per KV head to the flash kernel
and every other shape to the CUDA-core kernel of attention/prefill.py, passing `out` and
`max_query_len` through. The kernels themselves are stand-ins here; their results are checked
on a GPU (tests/gpu/test_prefill_fa_gpu.py, tests/gpu/test_attention_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.attention import prefill as prefill_attention
from voltserve.kernels.attention import prefill_fa as prefill_attention_fa
from voltserve.kernels.dispatch import KernelDispatch


def test_dispatch_resolves_the_flash_entry():
    ops = KernelDispatch("cuda", torch.float16, force_ref=False)  # resolving touches no device
    assert ops.impl["paged_attention"] == "cuda"
    assert ops.paged_attention is prefill_attention_fa.paged_attention_cuda


def test_dispatch_keeps_the_reference_off_fp16():
    # numba has no bf16 arrays: the prefill kernels are fp16 only.
    ops = KernelDispatch("cuda", torch.bfloat16, force_ref=False)
    assert ops.impl["paged_attention"] == "ref"


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,want",
    [
        (32, 8, 128, "flash"),
        (14, 2, 64, "flash"),  # group 7
        (64, 1, 128, "flash"),  # group 64 = ROWS
        (8, 8, 64, "flash"),
        (65, 1, 128, "cuda_core"),  # group past ROWS
        (8, 2, 256, "flash"),
        (24, 4, 256, "flash"),  # Qwen3.5-27B's full-attention layers: group 6
        (16, 2, 256, "flash"),  # Qwen3-Next: group 8
        (64, 1, 256, "flash"),  # group 64 = ROWS
        (65, 1, 256, "cuda_core"),
        (8, 2, 96, "cuda_core"),
        (8, 2, 512, "cuda_core"),
        (8, 8, 32, "cuda_core"),
    ],
)
def test_entry_routes_by_shape(monkeypatch, heads, kv_heads, head_dim, want):
    calls = []

    def stand_in(name):
        def fn(*args, **kw):
            calls.append((name, args, kw))
            return args[7]

        return fn

    monkeypatch.setattr(prefill_attention_fa, "paged_attention_fa_cuda", stand_in("flash"))
    monkeypatch.setattr(prefill_attention, "paged_attention_cuda", stand_in("cuda_core"))
    q = torch.zeros((3, heads, head_dim), dtype=torch.float16)
    cache = torch.zeros((2, kv_heads, 16, head_dim), dtype=torch.float16)
    tables = torch.zeros((1, 1), dtype=torch.int32)
    sl = torch.tensor([3], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    out = torch.empty_like(q)
    res = prefill_attention_fa.paged_attention_cuda(
        q, cache, cache, tables, sl, qsl, 0.125, out, max_query_len=3
    )
    assert res is out
    ((name, args, kw),) = calls
    assert name == want
    assert args[:6] == (q, cache, cache, tables, sl, qsl) and args[6] == 0.125
    assert kw == {"max_query_len": 3}
