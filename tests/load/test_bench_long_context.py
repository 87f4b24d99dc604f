"""CI smoke of load_tests/bench_long_context.py on the CPU (its engines in this process): every
context of every KV dtype measured, the prefixes reused from the prefix cache as the script
says, the floors counted from the bytes each KV dtype stores, and the --fit refusal parser
reading the engine's own refusal. Timings are not checked (a CPU box says nothing about them)."""

from __future__ import annotations

import json

import pytest
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.shared.config import EngineConfig
from voltserve.shared.startup import StartupError

from load_tests import bench_long_context as blc
from tests.load.scripts import run_main


def test_bench_long_context_cpu_smoke(tmp_path) -> None:
    out = tmp_path / "long.json"
    model = tmp_path / "tiny"
    run_main(
        "bench_long_context",
        ["--preset", "tiny", "--device", "cpu", "--max-positions", "128"]
        + ["--contexts", "32,128", "--ttft-context", "128", "--output-len", "8"]
        + ["--warmup-len", "16", "--max-num-batched-tokens", "64", "--weights", "fp16"]
        + ["--kv", "auto,fp8_e5m2", "--in-process", "--bandwidth-bytes", str(1 << 20)]
        + ["--model-dir", str(model), "--out", str(out)],
    )
    d = json.loads(out.read_text())
    assert d["errors"] == {} and d["bound"] == 128  # the model's 128 positions
    assert d["env"]["git_commit"] and d["env"]["time"] and d["device"] == "cpu"
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 128
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    auto, fp8 = d["runs"]
    assert (auto["kv"], fp8["kv"]) == ("auto", "fp8_e5m2")
    assert auto["kv_bytes_per_token"] == 4 * fp8["kv_bytes_per_token"]  # fp32 on the CPU
    for run in (auto, fp8):
        assert run["errors"] == {} and run["max_model_len"] == 128
        first, second = run["points"]
        # 128 first, from nothing; its prompt leaves room for the output within the bound
        assert (first["context"], first["prompt_len"], first["fresh"]) == (128, 120, True)
        assert first["prefill_tokens_computed"] == 120
        # 32 reuses one full 16-token block of it (the last token is always computed)
        assert (second["context"], second["cached_prompt_tokens"]) == (32, 16)
        assert second["prefill_tokens_computed"] == 16
        for p in run["points"]:
            read = run["weight_read_bytes"] + p["mean_context"] * run["kv_bytes_per_token"]
            assert p["floor_read_bytes"] == read
            assert p["decode_tok_s"] > 0 and p["fraction_of_floor"] > 0
    (ratio,) = d["kv_speed_ratios"]
    assert (ratio["kv"], ratio["against"], ratio["context"]) == ("fp8_e5m2", "auto", 128)
    assert ratio["floor_ratio"] > 1

    # --fit reads the engine's refusal of a context its KV cache cannot hold.
    with pytest.raises(StartupError) as e:
        ModelRunner(EngineConfig(model=str(model), max_model_len=128, cpu_kv_cache_bytes=3 * 8192))
    m = blc.REFUSAL.search(str(e.value))
    assert m is not None and int(m.group(2)) == 16 * int(m.group(1))


def test_bench_long_context_hybrid_cpu_smoke(tmp_path) -> None:
    """A hybrid model (tiny-hybrid: 3 Gated DeltaNet layers and 1 full-attention layer, its own
    rope): KV counted for the full-attention layer only, the recurrent state read and written
    once a step in every floor, prefix caching off (each context prefilled from nothing), and
    the longest context's speed over the shortest's reported."""
    out = tmp_path / "long.json"
    model = tmp_path / "hybrid"
    run_main(
        "bench_long_context",
        ["--preset", "tiny-hybrid", "--rope", "native", "--device", "cpu"]
        + ["--max-positions", "128", "--contexts", "32,128", "--ttft-context", "128"]
        + ["--output-len", "8", "--warmup-len", "16", "--max-num-batched-tokens", "64"]
        + ["--weights", "fp16", "--kv", "auto,fp8_e5m2", "--in-process"]
        + ["--bandwidth-bytes", str(1 << 20), "--model-dir", str(model), "--out", str(out)],
    )
    d = json.loads(out.read_text())
    assert d["errors"] == {}
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 128  # the model's own rope, only the length set
    assert cfg["rope_parameters"]["rope_type"] == "default"
    auto, fp8 = d["runs"]
    # one full-attention layer of 2 KV heads of 32, fp32 on the CPU
    assert auto["kv_bytes_per_token"] == 2 * 1 * 2 * 32 * 4
    state = 3 * (8 * 16 * 16 * 4 + (2 * 4 * 16 + 8 * 16) * 3 * 4)
    for run in (auto, fp8):
        assert run["errors"] == {} and run["state_bytes_per_sequence"] == state
        for p in run["points"]:
            assert p["cached_prompt_tokens"] == 0
            kv = p["mean_context"] * run["kv_bytes_per_token"]
            assert p["floor_read_bytes"] == run["weight_read_bytes"] + kv + 2 * state
        assert run["longest_over_shortest"]["contexts"] == [128, 32]
        assert run["longest_over_shortest"]["speed_ratio"] > 0
