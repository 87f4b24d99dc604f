"""On a CUDA GPU: every weight format at real vocabularies and widths, served by `voltserve serve`
at its default flags, greedy within a stated tolerance of transformers in fp32 on the same
(dequantized) weights. Skipped without CUDA; alone on the GPU (each server takes 90% of its
memory), so skipped in a pytest-xdist worker: `scripts/gpu_check.sh OUT real-shapes` runs it.

Cases: the Llama-3-8B shape with two layers (vocabulary 128,256, hidden 4096, intermediate
14,336, 32 heads over 8 KV heads of 128) in fp16 safetensors, AWQ int4 g128, GPTQ int4 g128
act-order, compressed-tensors W4A16 g128, compressed-tensors NVFP4 and MXFP4 (weights only),
GGUF Q4_K_M (llama.cpp's mix: Q6_K output.weight, Q4_K token_embd, Q4_K / Q6_K layers) and
GGUF Q8_0 (token_embd and output Q8_0 too); the
Qwen2.5-7B shape with two layers (vocabulary 152,064, hidden 3584, intermediate 18,944, 28 heads
over 4) in fp16 and AWQ; Gemma 3's 262,144-token vocabulary on the Llama widths in fp16. Each
server starts with only --host / --port (and --tokenizer for a GGUF file, whose metadata cannot
spell the random checkpoints' word-level tokens): device cuda, fp16, the KV cache sized by the
profile forward of 8192 tokens, max-num-batched-tokens 8192, decode CUDA graphs. Requests and
checks: tests/real_shapes.py (a batch of 64 with an 8,150-token prompt joining it, prefilled in
chunks beside them; then 64 alone, the batch-64 decode graph; 16 greedy tokens each; every
request ends with finish_reason "length").

Tolerance, in logits, of the reference's best logit minus its logit of the server's token and
of the difference in that token's logprob: TOL_FP16 = 0.10 for fp16, TOL_QUANT = 0.15 for the
quantized formats. The logits of these random checkpoints have a spread of 0.02 x sqrt(hidden)
~ 1.2-1.3 and the best of 128K-262K draws lies near 6. fp16 carries 11 significant bits: a
logit near 6 is stored within 0.002, and the hidden state reaches the head after a few dozen
fp16 roundings over the two layers (each a relative 2^-11 ~ 5e-4, mostly independent), an error
of order 1e-3 relative, ~0.01 in the best logit; the 8K prompt's attention accumulates in fp32.
0.10 leaves a margin of ~10 over that. A quantized kernel rounds each dequantized weight to fp16
once more and sums in other orders than the reference: 0.15. What the test is for lies far
outside either: a kernel that computes the wrong rows, skips a tile or a block, or launches
no grid past 65,535 rows moves logits by their own spread (~1.3) or to NaN.

The checkpoints are built once per session on the CPU beside the running cases (~40 GB under a
temporary folder, removed at the end; VOLTSERVE_REAL_SHAPES_DIR keeps them in a folder of its
own for the next run). The servers share the session's kernel cache (tests/conftest.py;
VOLTSERVE_TEST_CACHE_DIR keeps one for the next run), so each case compiles only the kernels
its format adds. VOLTSERVE_REAL_SHAPES_OUT: a folder for real_shapes.json (device, date,
commit, and each case's timings, largest differences and problems).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests import real_shapes as rs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        bool(os.environ.get("PYTEST_XDIST_WORKER")),
        reason="needs the whole GPU: run alone (scripts/gpu_check.sh OUT real-shapes)",
    ),
]

TOL_FP16 = 0.10
TOL_QUANT = 0.15
SIZES = rs.Sizes(long_prompt=8150, batch=64, short_min=64, short_max=512, max_tokens=16)

# In the order they run: each quantized case's writer works in the background meanwhile.
CASES = [
    ("llama3-8b", "fp16"),
    ("llama3-8b", "gguf-q4_k_m"),
    ("llama3-8b", "gguf-q8_0"),
    ("llama3-8b", "awq"),
    ("llama3-8b", "gptq"),
    ("llama3-8b", "ct"),
    ("llama3-8b", "ct-nvfp4"),
    ("llama3-8b", "ct-mxfp4"),
    ("qwen2.5-7b", "fp16"),
    ("qwen2.5-7b", "awq"),
    ("vocab262k", "fp16"),
]


@pytest.fixture(scope="module")
def builds(request):
    kept = os.environ.get("VOLTSERVE_REAL_SHAPES_DIR")
    root = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="voltserve-real-shapes-"))
    root.mkdir(parents=True, exist_ok=True)
    b = rs.Builds(root, workers=6)
    # Only the cases this run selected (-k): the others' checkpoints would compete for the CPU.
    chosen = {
        (item.callspec.params["shape"], item.callspec.params["fmt"])
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    b.start([case for case in CASES if case in chosen])
    try:
        yield b
    finally:
        b.close()
        if not kept:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def references():
    with ThreadPoolExecutor(1, thread_name_prefix="real-shapes-reference") as pool:
        yield pool


@pytest.fixture(scope="module")
def results():
    out = os.environ.get("VOLTSERVE_REAL_SHAPES_OUT")
    r = rs.Results(Path(out) / "real_shapes.json" if out else None, "cuda")
    yield r


@pytest.mark.parametrize(("shape", "fmt"), CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_default_serve_is_greedy_within_tolerance_of_fp32(
    shape, fmt, builds, references, results, tmp_path, rng
) -> None:
    tol = TOL_FP16 if fmt == "fp16" else TOL_QUANT
    with results.case(shape, fmt, tol) as record:
        built = builds.get(shape, fmt)
        report = rs.serve_and_check(
            built, tmp_path, SIZES, rng, tol, torch.device("cuda"), references
        )
        record(report)
    assert report.problems == [], (
        f"{len(report.problems)} problems in {report.requests} requests; the first:\n"
        + "\n".join(report.problems[:20])
        + f"\nserver log tail:\n{report.server_log_tail}"
    )
