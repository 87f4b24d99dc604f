"""On a CUDA GPU: the structured-output mask kernel equals its torch reference at a real
vocabulary (Llama 3's 128256) and batch, and the engine's graph decode path with constrained and
unconstrained requests in one batch keeps every constraint. Skipped without CUDA."""

from __future__ import annotations

import re

import pytest
import torch
from voltserve.kernels.sampling import grammar_mask
from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "V,N,M", [(128256, 256, 256), (128256, 64, 7), (151936, 8, 3), (1000, 4, 4)]
)
def test_mask_kernel_equals_reference(V: int, N: int, M: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(V + N + M)
    logits = torch.randn(N, V, device="cuda", generator=g)
    W = (V + 31) // 32
    bitmask = torch.randint(
        -(1 << 31), 1 << 31, (M, W), device="cuda", generator=g, dtype=torch.int64
    )
    bitmask = bitmask.to(torch.int32)
    rows = torch.randperm(N, device="cuda", generator=g)[:M]
    want = logits.clone()
    grammar_mask.apply_token_bitmask_ref(want, bitmask, rows)
    got = logits.clone()
    untouched = torch.ones(N, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    got[untouched] = float("nan")  # rows without a mask must not be written
    want[untouched] = float("nan")
    grammar_mask.apply_token_bitmask_cuda(got, bitmask, rows)
    torch.cuda.synchronize()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_graph_decode_keeps_constraints(dtype: str) -> None:
    pytest.importorskip("xgrammar")  # without it every constrained request fails at compile
    cfg = EngineConfig(
        model=str(checkpoint("qwen2")),
        dtype=dtype,
        device="cuda",
        num_kv_blocks=256,
        max_model_len=256,
        max_graph_batch_size=16,
    )
    engine = LLMEngine(cfg)
    assert engine.runner.graphs is not None
    tok = tokenizer()
    pattern = r"[a-z]{2,6}-[0-9]{1,3}"
    choices = ["alpha", "beta", "gamma delta"]
    prompts, params = [], []
    for i in range(12):
        prompts.append(tok.encode(f"item {i}:"))
        if i % 3 == 0:
            c = {"type": "regex", "value": pattern}
        elif i % 3 == 1:
            c = {"type": "choice", "value": choices}
        else:
            c = None
        params.append(
            SamplingParams(
                max_tokens=40, temperature=1.0 if i % 2 else 0.0, seed=100 + i, structured=c
            )
        )
    before = engine.runner.graphs.num_replays
    outs = engine.generate(prompts, params)
    assert engine.runner.graphs.num_replays > before  # the constrained rows ran in graph steps
    for i, out in enumerate(outs):
        text = tok.decode(out, skip_special_tokens=True)
        if i % 3 == 0:
            assert re.fullmatch(pattern, text), text
        elif i % 3 == 1:
            assert text in choices, text
