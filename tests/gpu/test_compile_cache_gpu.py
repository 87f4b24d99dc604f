"""On a CUDA GPU: kernels loaded from the kernel cache run and give bit-identical results to the
ones compiled (and match their torch references); an engine start-up with a warm cache compiles
nothing (every traced kernel is loaded), its graph capture compiles nothing either way, and it
generates the same tokens. Each test has its own cache folder (tmp_path). Skipped without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.checkpoints import checkpoint
from voltserve.cli import command as voltserve_command

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KERNELS_SCRIPT = textwrap.dedent(
    """
    import hashlib, json
    import torch
    from voltserve.kernels.runtime import compile_cache
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.kernels.linear.gemv import gemv_ref
    from voltserve.kernels.elementwise.rmsnorm import rms_norm_ref

    ops = KernelDispatch("cuda", torch.float16)
    assert ops.impl["rms_norm"] == "cuda" and ops.impl["gemv"] == "cuda", ops.impl
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(5, 4096, generator=g, device="cuda", dtype=torch.float16)
    w = torch.rand(4096, generator=g, device="cuda", dtype=torch.float16) + 0.5
    m = torch.randn(1024, 4096, generator=g, device="cuda", dtype=torch.float16) * 0.02
    outs = {"rms_norm": ops.rms_norm(x, w, 1e-5), "gemv": ops.gemv(x[:1].contiguous(), m)}
    refs = {"rms_norm": rms_norm_ref(x, w, 1e-5), "gemv": gemv_ref(x[:1], m)}
    torch.cuda.synchronize()
    print(json.dumps({
        "stats": compile_cache.stats.snapshot(),
        "sha": {k: hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest() for k, v in outs.items()},
        "err": {k: (outs[k].float() - refs[k].float()).abs().max().item() for k in outs},
    }))
    """
)

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.services.executor.request import Request
    from voltserve.shared.config import EngineConfig
    from voltserve.shared.sampling_params import SamplingParams

    # The test's own helpers by name (the checkout's root stays off sys.path: tests/conftest.py)
    import types
    sys.modules["tests"] = types.ModuleType("tests")
    sys.modules["tests"].__path__ = [TESTS_DIR]
    from tests.checkpoints import drive

    cfg = EngineConfig(model=sys.argv[1], dtype="float16", device="cuda", num_kv_blocks=128,
                       max_model_len=256, max_graph_batch_size=16)
    runner = ModelRunner(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reqs = [Request(f"r{i}", [3 + i, 17, 29, 5 * i + 1], params, seed=i, arrival_time=0.0)
            for i in range(3)]
    drive(runner, reqs, 8, chunk=32)
    r = runner.compile_report
    print(json.dumps({
        "report": {k: getattr(r, k) for k in
                   ("launches", "kernels", "already", "loaded", "compiled", "in_workers")},
        "compiled_in_capture": runner.compiled_in_capture,
        "graphs": runner.graphs is not None,
        "tokens": [q.output_token_ids for q in reqs],
    }))
    """
).replace("TESTS_DIR", repr(str(Path(__file__).resolve().parents[1])))


def run(script: str, cache: Path, *args: str) -> dict:
    env = dict(os.environ)
    env["VOLTSERVE_CACHE_DIR"] = str(cache)
    proc = subprocess.run(
        [sys.executable, "-P", "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cached_kernel_gives_the_compiled_kernels_results(tmp_path):
    cache = tmp_path / "cache"
    cold = run(KERNELS_SCRIPT, cache)
    assert cold["stats"]["saved"] >= 2 and cold["stats"]["hits"] == 0, cold
    warm = run(KERNELS_SCRIPT, cache)
    assert warm["stats"]["misses"] == 0 and warm["stats"]["saved"] == 0, warm
    assert warm["stats"]["hits"] >= 2, warm
    assert warm["sha"] == cold["sha"]  # bit for bit
    assert warm["err"]["rms_norm"] < 2e-2 and warm["err"]["gemv"] < 2e-2, warm


def test_a_warm_start_loads_every_kernel_and_capture_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    model = str(checkpoint("llama"))
    cold = run(ENGINE_SCRIPT, cache, model)
    assert cold["graphs"] and cold["compiled_in_capture"] == [], cold
    rep = cold["report"]
    assert rep["kernels"] > 5 and rep["compiled"] + rep["in_workers"] > 0, rep
    warm = run(ENGINE_SCRIPT, cache, model)
    rep = warm["report"]
    assert rep["kernels"] == cold["report"]["kernels"], (rep, cold["report"])
    assert rep["compiled"] == 0 and rep["in_workers"] == 0, rep
    assert rep["loaded"] == rep["kernels"] - rep["already"], rep
    assert warm["compiled_in_capture"] == [], warm
    assert warm["tokens"] == cold["tokens"]


def test_warmup_fills_the_cache_that_an_engine_with_the_same_flags_loads(tmp_path):
    cache = tmp_path / "cache"
    model = str(checkpoint("llama"))
    env = dict(os.environ)
    env["VOLTSERVE_CACHE_DIR"] = str(cache)
    # ENGINE_SCRIPT's engine: fp16, max_model_len 256, decode graphs for 1..16 sequences.
    cmd = [*voltserve_command(), "warmup", "--model", model, "--device", "cuda"]
    cmd += ["--dtype", "float16", "--max-model-len", "256", "--max-num-seqs", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "voltserve warmup:" in proc.stdout and "kernels for" in proc.stdout, proc.stdout
    assert "start-up: compiling kernels took" in proc.stderr, proc.stderr
    warm = run(ENGINE_SCRIPT, cache, model)
    rep = warm["report"]
    assert rep["compiled"] == 0 and rep["in_workers"] == 0 and rep["loaded"] > 5, rep
