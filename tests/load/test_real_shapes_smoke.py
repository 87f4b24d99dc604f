"""tests/real_shapes.py on the CPU, at a tiny shape: the code tests/gpu/test_real_shapes_gpu.py
runs at real shapes on a GPU. Every format is written by the same builders (in Builds' threads)
and the model voltserve loads from it generates greedy tokens that real_shapes'
teacher-forced check finds within 1e-3 of the format's fp32 reference (fp32 on both sides);
one GGUF file (served with the float folder's tokenizer) goes through serve_and_check whole,
`voltserve serve` and all. The GPU cases' shapes are the real models' configs."""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from load_tests import common
from tests import real_shapes as rs
from tests.checkpoints import drive
from tests.gpu import test_real_shapes_gpu as gpu

TINY_CASES = [("tiny-llama", f) for f in rs.FORMATS] + [("tiny-qwen2", "awq")]
EXACT = 1e-3  # fp32 against fp32: the same products summed in other orders


@pytest.fixture(scope="module")
def builds():
    root = Path(tempfile.mkdtemp(prefix="voltserve-real-shapes-"))
    b = rs.Builds(root, workers=2)
    b.start(TINY_CASES)
    yield b
    b.close()
    shutil.rmtree(root, ignore_errors=True)


def test_the_gpu_cases_are_the_real_shapes() -> None:
    def config(shape: str):
        s = rs.SHAPES[shape]
        return common.make_hf_config(s.preset, **dict(s.overrides))

    want = {
        # vocab, hidden, intermediate, heads, KV heads, head_dim
        "llama3-8b": (128256, 4096, 14336, 32, 8, 128),
        "qwen2.5-7b": (152064, 3584, 18944, 28, 4, 128),
        "vocab262k": (262144, 4096, 14336, 32, 8, 128),
    }
    for shape, (vocab, hidden, inter, heads, kv, head_dim) in want.items():
        c = config(shape)
        got = (c.vocab_size, c.hidden_size, c.intermediate_size)
        got += (c.num_attention_heads, c.num_key_value_heads, c.hidden_size // heads)
        assert got == (vocab, hidden, inter, heads, kv, head_dim), shape
        assert c.num_hidden_layers == rs.LAYERS and rs.SHAPES[shape].config["vocab_size"] == vocab
    assert {f for s, f in gpu.CASES if s == "llama3-8b"} == set(rs.FORMATS)
    qwen = {f for s, f in gpu.CASES if s == "qwen2.5-7b"}
    assert "fp16" in qwen and len(qwen) >= 2
    assert ("vocab262k", "fp16") in gpu.CASES
    # the long prompt fits every context with its output, and cannot be prefilled in the same
    # step as the batch's decodes: it is chunked
    for shape in {s for s, _ in gpu.CASES}:
        limit = config(shape).max_position_embeddings
        assert gpu.SIZES.long_prompt + gpu.SIZES.max_tokens <= limit, shape
    budget = EngineConfig(model="x").max_num_batched_tokens
    assert gpu.SIZES.long_prompt + gpu.SIZES.batch > budget
    assert gpu.SIZES.batch == 64 and gpu.TOL_FP16 < gpu.TOL_QUANT


@pytest.mark.parametrize(("shape", "fmt"), TINY_CASES, ids=[f"{s}-{f}" for s, f in TINY_CASES])
def test_each_format_builds_and_loads_as_its_reference(shape, fmt, builds, rng) -> None:
    built = builds.get(shape, fmt)
    assert built.model.exists() and built.reference.is_dir()
    assert (built.tokenizer is not None) == fmt.startswith("gguf-")
    runner = ModelRunner(EngineConfig(model=str(built.model), num_kv_blocks=64))
    assert runner.vocab_size == built.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    prompts = [[rng.randrange(16, built.vocab_size) for _ in range(n)] for n in (5, 40)]
    reqs = [Request(f"r{i}", p, params, seed=i, arrival_time=0.0) for i, p in enumerate(prompts)]
    drive(runner, reqs, 4, chunk=16)
    model = rs.load_reference(built)
    report = rs.Report()
    for r in reqs:
        c = rs.Completion(
            r.prompt_token_ids,
            [t.token_id for t in r.trace],
            [t.logprob for t in r.trace],
            finish_reason="length",
        )
        assert rs.reference_problems(model, c, 4, EXACT, report) == []
    assert report.max_gap < EXACT and report.max_logprob_diff < EXACT
    # a wrong token is seen: the reference's worst in place of the first request's first token
    r = reqs[0]
    with torch.no_grad():
        worst = int(model(torch.tensor([r.prompt_token_ids])).logits[0, -1].argmin())
    tokens = [worst] + [t.token_id for t in r.trace][1:]
    wrong = rs.Completion(r.prompt_token_ids, tokens, [t.logprob for t in r.trace], "length")
    assert rs.reference_problems(model, wrong, 4, EXACT, rs.Report())[0].startswith("position 0")


@pytest.mark.slow  # a whole `voltserve serve` start (~45 s of CPU on the 2-core machine)
def test_a_gguf_file_served_on_the_cpu_passes_serve_and_check(builds, rng, tmp_path) -> None:
    built = builds.get("tiny-llama", "gguf-q4_k_m")
    sizes = rs.Sizes(long_prompt=600, batch=6, short_min=8, short_max=48, max_tokens=4)
    with ThreadPoolExecutor(1) as references:
        report = rs.serve_and_check(
            built, tmp_path, sizes, rng, gpu.TOL_QUANT, torch.device("cpu"), references
        )
    assert report.problems == [], report.problems[:10]
    assert report.requests == 2 * sizes.batch + 1
    assert report.serve_ready_s > 0 and report.requests_s > 0 and report.reference_s > 0
