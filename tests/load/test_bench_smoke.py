"""CI smoke of the benchmark scripts on the CPU: each runs end to end at a tiny size and writes
its JSON with the keys the GPU run is read by. Timings are not checked (a CPU box says nothing
about them); token counts and completions are, since they are exact.

Each script runs in this process, through its main(argv) (what `python load_tests/X.py ARGS`
calls): a subprocess would import torch and transformers again, seconds of every test on a
2-core CI box. The servers the scripts launch (`voltserve serve`) are still processes of their
own. The demo model and the random checkpoints (dense, and bench_moe's MoE one) are written once
per test process and only read by the scripts."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

from load_tests import bench_moe, bench_serving, common  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.load.scripts import run_main  # noqa: E402


def _run(args: list[str]) -> None:
    """`python load_tests/NAME.py ARGS...` in this process (tests/load/scripts.py)."""
    run_main(Path(args[0]).stem, args[1:])


@functools.cache
def _demo_model() -> Path:
    """`voltserve make-demo-model DIR`, once per test process (the scripts only read it)."""
    from voltserve.services.executor.demo_model import main as make_demo_model

    path = checkpoints._root() / "bench-demo"
    make_demo_model([str(path)])
    return path


@functools.cache
def _tiny_checkpoint() -> Path:
    """A random-weight `tiny` preset checkpoint (fp32), once per test process."""
    path = checkpoints._root() / "bench-tiny"
    return common.write_random_checkpoint(path, "tiny", "cpu", common.torch.float32)


@functools.cache
def _tiny_moe_checkpoint() -> Path:
    """bench_moe's checkpoint at its tiny shape (2 layers of 8 experts, fp32), once per test
    process: the folder gpu_check's MoE serving run launches, at the Qwen3-30B-A3B shape."""
    path = checkpoints._root() / "bench-moe-tiny"
    if not bench_moe.checkpoint_matches(path, 2, 0, "tiny"):
        cfg = bench_moe.make_config(2, common.torch.float32, "tiny")
        model = bench_moe.build_hf_model(cfg, "cpu", common.torch.float32, 0)
        bench_moe.write_checkpoint(model, cfg, path, 0, "tiny")
    return path


def test_weight_bytes_match_llama3_8b_parameter_count():
    # Llama-3-8B has 8,030,261,248 parameters; the embedding is 128256 x 4096.
    cfg = common.make_hf_config("llama3-8b")
    wb = common.weight_bytes(cfg, common.torch.float16)
    assert wb["total_bytes"] == 2 * 8_030_261_248
    assert wb["read_per_token_bytes"] == wb["total_bytes"] - 2 * 128256 * 4096
    assert common.kv_bytes_per_token(cfg, common.torch.float16) == 2 * 32 * 8 * 128 * 2
    # Tied embeddings (Qwen2.5-0.5B): the lm_head reads the embedding, so it is counted.
    q = common.make_hf_config("qwen2.5-0.5b")
    wq = common.weight_bytes(q, common.torch.float16)
    assert wq["read_per_token_bytes"] == wq["total_bytes"]


def test_hybrid_floor_bytes_of_the_qwen3_5_27b_shape():
    """Qwen3.5-27B: 26,895,998,464 parameters at its 64 layers (5120 hidden, a 248,320 x 5120
    embedding and lm_head); at 16 layers (--layers) 12 Gated DeltaNet layers and 4 full-attention
    ones, only those keeping KV (4 KV heads of 256); each GDN layer a 48 x 128 x 128 fp32 state
    and a conv state over 2 x 16 x 128 + 48 x 128 channels x 3 positions."""
    f16 = common.torch.float16
    full = common.make_hf_config("qwen3.5-27b")
    assert common.weight_bytes(full, f16)["total_bytes"] == 2 * 26_895_998_464
    cfg = common.make_hf_config("qwen3.5-27b", **common.layer_overrides(16))
    assert common.attention_layers(cfg) == 4
    assert common.kv_bytes_per_token(cfg, f16) == 2 * 4 * 4 * 256 * 2
    state = 48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2
    assert common.state_bytes_per_sequence(cfg, f16) == 12 * state
    dense = common.make_hf_config("llama3-8b")
    assert common.state_bytes_per_sequence(dense, f16) == 0


def test_hybrid_moe_floor_bytes_of_the_qwen3_5_35b_a3b_shape():
    """Qwen3.5-35B-A3B, counted by hand from its published widths: hidden 2048, a 248,320 x 2048
    embedding and lm_head; 30 Gated DeltaNet layers (16 key / 32 value heads of 128, conv 4) and
    10 gated full-attention ones (16 query heads of 256 with their gate, 2 KV heads); every layer
    a router over 256 experts of 512, the experts, a shared expert of 512 and its gate, two
    norms. 34,660,610,688 parameters; a token reads 8 of the 256 experts of a layer. At 8 layers
    (--layers): 6 GDN layers with their state, 2 with KV."""
    f16 = common.torch.float16
    H, V, E, k, inter = 2048, 248320, 256, 8, 512
    qkv = 2 * 16 * 128 + 32 * 128  # the GDN q, k and v channels
    gdn = qkv * H + 32 * 128 * H + 2 * 32 * H + qkv * 4 + 2 * 32 + 128 + H * 32 * 128
    attn = 2 * 16 * 256 * H + 2 * 2 * 256 * H + H * 16 * 256 + 2 * 256
    expert = 3 * inter * H
    moe = E * H + E * expert + 3 * 512 * H + H
    params = 2 * V * H + H + 30 * gdn + 10 * attn + 40 * (moe + 2 * H)
    assert params == 34_660_610_688
    full = common.make_hf_config("qwen3.5-35b-a3b")
    wb = common.weight_bytes(full, f16)
    assert wb["total_bytes"] == 2 * params
    assert wb["routed_expert_bytes"] == 2 * 40 * E * expert
    assert wb["read_per_token_bytes"] == 2 * (params - V * H - 40 * (E - k) * expert)
    assert (wb["num_experts"], wb["experts_per_token"]) == (E, k)
    cfg = common.make_hf_config("qwen3.5-35b-a3b", **common.layer_overrides(8))
    assert common.attention_layers(cfg) == 2
    assert common.kv_bytes_per_token(cfg, f16) == 2 * 2 * 2 * 256 * 2
    state = 32 * 128 * 128 * 4 + qkv * 3 * 2
    assert common.state_bytes_per_sequence(cfg, f16) == 6 * state
    # a batch's step reads the distinct experts its tokens were routed to
    w8 = common.weight_bytes(cfg, f16)
    assert common.step_weight_bytes(w8, 1) == w8["read_per_token_bytes"]
    distinct = E * (1 - (1 - k / E) ** 64)  # 222.4 of 256
    extra = 2 * 8 * (distinct - k) * expert
    assert abs(common.step_weight_bytes(w8, 64) - w8["read_per_token_bytes"] - extra) < 1
    dense = common.weight_bytes(common.make_hf_config("qwen3.5-27b", num_hidden_layers=4), f16)
    assert "num_experts" not in dense
    assert common.step_weight_bytes(dense, 64) == dense["read_per_token_bytes"]


def test_kv_bytes_per_element_follows_the_cache_dtype():
    """The floors' KV bytes under --kv-cache-dtype: one byte for every fp8 name, two for fp16
    whatever the run dtype, the run dtype's for auto; a name the server refuses is refused."""
    import torch

    for kv in ("fp8", "fp8_e5m2", "fp8_e4m3"):
        assert common.kv_bytes_per_element(kv, torch.float32) == 1
    assert common.kv_bytes_per_element("fp16", torch.float32) == 2
    assert common.kv_bytes_per_element("auto", torch.float32) == 4
    assert common.kv_bytes_per_element("auto", torch.float16) == 2
    with pytest.raises(ValueError, match="int8"):
        common.kv_bytes_per_element("int8", torch.float16)


def test_datasets_stay_in_vocab_and_share_prefix(seed):
    vocab = int(np.random.default_rng(seed).integers(100, 5000))
    args = bench_serving.parse_args(
        [
            "--dataset",
            "prefix",
            "--prefix-len",
            "12",
            "--input-len",
            "5",
            "--output-len",
            "3",
            "--num-prompts",
            "6",
            "--seed",
            str(seed),
            "--engine-only",
        ]
    )
    prompts = bench_serving.build_dataset(args, vocab)
    assert len(prompts) == 6
    assert all(len(p.token_ids) == 17 and p.output_len == 3 for p in prompts)
    assert all(p.token_ids[:12] == prompts[0].token_ids[:12] for p in prompts)
    assert all(0 <= t < vocab for p in prompts for t in p.token_ids)
    again = bench_serving.build_dataset(args, vocab)
    assert [p.token_ids for p in again] == [p.token_ids for p in prompts]  # seeded
    gaps = np.diff([0.0, *bench_serving.arrival_times(2000, 50.0, seed)])
    assert 0.015 < gaps.mean() < 0.025  # Poisson at 50 req/s
    # Warm-up prompts are as long as the measured ones and share no KV block (16 tokens) with
    # any of them, so the prefix cache gives the measured requests nothing from the warm-up.
    warm = bench_serving.build_warmup(args, vocab)
    assert len(warm) == args.num_warmup and all(len(w.token_ids) == 17 for w in warm)
    assert all(w.output_len == 3 and 0 <= min(w.token_ids) for w in warm)
    assert not {tuple(w.token_ids[:12]) for w in warm} & {tuple(p.token_ids[:12]) for p in prompts}


@pytest.mark.slow  # a benchmark end to end: scheduled first
def test_bench_decode_cpu_smoke(tmp_path):
    out = tmp_path / "decode.json"
    _run(
        [
            "load_tests/bench_decode.py",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--prompt-len",
            "16",
            "--output-len",
            "4",
            "--runs",
            "1",
            "--warmup",
            "1",
            "--hf-runs",
            "1",
            "--hf-warmup",
            "0",
            "--batch-sizes",
            "2,6",
            "--context",
            "40",
            # A small step budget chunks the batch's prefill over several steps, so requests
            # start decoding at different steps: the timed window must still be full batches.
            "--max-num-batched-tokens",
            "64",
            "--decode-steps",
            "3",
            "--decode-warmup",
            "1",
            # A 1 MiB copy measures a bandwidth as well as the CPU default of 64 MiB does.
            "--bandwidth-bytes",
            str(1 << 20),
            # A server's bound rather than the shortest that holds the run.
            "--max-model-len",
            "256",
            "--out",
            str(out),
        ]
    )
    d = json.loads(out.read_text())
    assert d["errors"] == {}
    assert d["engine_config"]["max_model_len"] == 256
    assert d["copy_bandwidth"]["bandwidth_GBps"] > 0
    assert d["floor"]["ms_per_token"] > 0
    # the floor with the KV at the decode's mean context (16 + 4 / 2 tokens) added
    kv = d["model"]["kv_bytes_per_token"] * 18
    assert d["floor"]["kv_read_bytes"] == kv and d["floor"]["state_read_write_bytes"] == 0
    assert d["floor"]["with_context_ms_per_token"] > d["floor"]["ms_per_token"]
    for key in ("decode_tok_s", "ms_per_token", "ttft_ms", "roofline_fraction"):
        assert d["engine"][key] > 0, key
    assert d["transformers"]["decode_tok_s"] > 0
    assert d["speedup_vs_transformers"] > 0
    assert 0 <= d["greedy_agreement_tokens"] <= 4
    assert [b["batch_size"] for b in d["batched"]] == [2, 6]
    for b in d["batched"]:
        assert b["context"] == 40 and b["steps_not_full_batch"] == 0
        assert b["run_step_ms"] > 0 and b["run_floor_ms"] > b["floor_ms"]
        assert len(b["step_ms_all"]) == 3
        assert b["mean_context"] >= 40 + 1 + 1 + 1
        for key in ("step_ms", "floor_ms", "ratio_to_floor", "output_tok_s"):
            assert b[key] > 0, key
    # 6 x 40 prompt tokens at 64 a step: the prefill spans several steps.
    assert d["batched"][1]["prefill_steps"] >= 4
    assert d["env"]["torch"] and "git_commit" in d["env"]


@pytest.mark.slow  # a benchmark end to end: scheduled first
def test_bench_serving_engine_only_prefix_cpu_smoke(tmp_path):
    model = _tiny_checkpoint()
    out = tmp_path / "engine.json"
    _run(
        [
            "load_tests/bench_serving.py",
            "--engine-only",
            "--model-dir",
            str(model),
            "--dataset",
            "prefix",
            "--prefix-len",
            "16",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--num-prompts",
            "6",
            "--max-concurrency",
            "3",
            "--request-rate",
            "200",
            "--out",
            str(out),
            "--serve-args=--device cpu",
        ]
    )
    d = json.loads(out.read_text())
    e = d["engine"]
    assert e["completed"] == 6 and e["failed"] == 0
    assert e["total_output_tokens"] == 24 and e["total_input_tokens"] == 6 * 24
    # The shared prefix is one full 16-token block: later requests hit the prefix cache.
    assert e["engine"]["stats"]["prefix_cache_hits"] > 0
    assert "http" not in d
    assert Path(d["plots"][0]).exists()


def test_bench_serving_writes_a_preset_at_fewer_layers(tmp_path):
    """--preset NAME --layers N writes the preset's widths with N layers (the overrides recorded
    in the folder's marker, as bench_decode's) and serves it; --layers names a --preset's
    layers, so it is refused without one."""
    model, out = tmp_path / "model", tmp_path / "serving.json"
    args = ["load_tests/bench_serving.py", "--engine-only", "--preset", "tiny", "--layers", "1"]
    args += ["--model-dir", str(model), "--num-prompts", "2", "--input-len", "8"]
    args += ["--output-len", "3", "--num-warmup", "0", "--no-plots"]
    _run([*args, "--out", str(out), "--serve-args=--device cpu"])
    d = json.loads(out.read_text())
    assert d["errors"] == {} and d["engine"]["completed"] == 2
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] == 1
    assert common.checkpoint_matches(model, "tiny", common.layer_overrides(1))
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--launch", str(model), "--layers", "1"])


@pytest.mark.slow  # a benchmark end to end: scheduled first
def test_bench_serving_moe_transformers_baseline_cpu_smoke(tmp_path):
    """The serving benchmark on an MoE checkpoint folder (bench_moe's): transformers at batch N
    on it and the engine on the same prompts, with the ratio. (The HTTP phase launches
    `voltserve serve` on the folder, as for a dense one: test_bench_serving_launch_cpu_smoke.)"""
    out = tmp_path / "moe.json"
    args = ["load_tests/bench_serving.py", "--engine-only", "--transformers-baseline"]
    args += ["--model-dir", str(_tiny_moe_checkpoint()), "--num-prompts", "2", "--input-len", "8"]
    args += ["--output-len", "3", "--num-warmup", "0", "--hf-batch-size", "2", "--no-plots"]
    _run([*args, "--out", str(out), "--serve-args=--device cpu"])
    d = json.loads(out.read_text())
    assert d["errors"] == {}
    assert d["dataset"]["vocab_size"] == bench_moe.TINY["vocab_size"]
    t = d["transformers"]
    assert t["batch_size"] == 2 and t["num_prompts"] == 2 and t["total_output_tokens"] == 6
    e = d["engine"]
    assert e["completed"] == 2 and e["total_output_tokens"] == 6
    assert set(d["speedup_vs_transformers"]) == {"engine"}


@pytest.mark.skipif(
    importlib.util.find_spec("voltserve.services.launcher") is None,
    reason="`voltserve serve` (voltserve.services.launcher) is not in this tree yet",
)
@pytest.mark.slow  # a benchmark end to end: scheduled first
def test_bench_serving_launch_cpu_smoke(tmp_path):
    model = _demo_model()
    out = tmp_path / "serving.json"
    _run(
        [
            "load_tests/bench_serving.py",
            "--launch",
            str(model),
            "--num-prompts",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--compare-engine",
            "--compare-structured",
            "--transformers-baseline",
            "--hf-max-prompts",
            "8",
            "--hf-batch-size",
            "4",
            "--launch-timeout",
            "180",
            "--out",
            str(out),
            "--",
            "--device",
            "cpu",
            "--log-level",
            "debug",
        ],
    )
    d = json.loads(out.read_text())
    assert d["errors"] == {}
    # The executor's step log (debug level) as read back from the server log: every request
    # (2 warm-ups of 4 tokens, 8 measured of 8) reached the engine once and got each of its
    # tokens in one step's outputs.
    steps = d["http"]["executor_steps"]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert sum(s["added"] for s in steps) == 10
    assert sum(s["outputs"] for s in steps) == 2 * 4 + 8 * 8
    assert steps[-1]["running"] == 0 and steps[-1]["waiting"] == 0
    assert all(s["t"] < d["http"]["duration_s"] + 5 for s in steps)
    # The scheduler's placements (debug level) of the 8 measured requests, not the warm-ups.
    placed = d["http"]["scheduler_placements"]
    assert placed["n"] == 8, placed
    assert 0 <= placed["first_ms"] <= placed["median_ms"] <= placed["last_ms"]
    assert placed["last_ms"] < 1e3 * d["http"]["duration_s"]
    for name in ("http", "engine"):
        m = d[name]
        assert m["completed"] == 8 and m["failed"] == 0, m.get("errors")
        assert m["total_output_tokens"] == 64 and m["output_tokens_short"] == 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "p99"):
                assert m[f"{stat}_{metric}_ms"] is not None, (name, stat, metric)
        for key in ("request_throughput", "output_throughput", "total_token_throughput"):
            assert m[key] > 0
    assert set(d["services_overhead"]) >= {"median_ttft_ms", "median_itl_ms"}
    # --compare-structured: a json_schema run against the same server on prompts of its own
    # (the plain run's would hit the prefix cache), each request its full length.
    assert d["dataset"]["structured_seed"] not in (None, d["args"].get("seed", 0))
    for name, structured in (("http", False), ("http_structured", True)):
        m = d[name]
        assert m["structured"] is structured
        assert m["completed"] == 8 and m["failed"] == 0, m.get("errors")
        assert m["total_output_tokens"] == 64 and m["output_tokens_short"] == 0
    cost = d["structured_cost"]
    assert cost["output_throughput_ratio"] > 0 and cost["median_itl_ms_diff"] is not None
    assert d["transformers"]["output_throughput"] > 0
    assert d["transformers"]["total_output_tokens"] == 64
    assert set(d["speedup_vs_transformers"]) == {"http", "engine"}
    assert all(Path(p).exists() for p in d["plots"])
    assert (tmp_path / "serving_server.log").exists()


@pytest.mark.slow  # a benchmark end to end: scheduled first
def test_profile_serving_steps_cpu_smoke(tmp_path):
    model = _tiny_checkpoint()
    out = tmp_path / "profile.json"
    _run(
        [
            "load_tests/profile_serving_steps.py",
            "--model-dir",
            str(model),
            "--num-prompts",
            "6",
            "--input-len",
            "40",
            "--output-len",
            "12",
            "--profile-steps",
            "1,9",
            "--out",
            str(out),
            "--serve-args=--device cpu --max-num-batched-tokens 64",
        ]
    )
    d = json.loads(out.read_text())
    steps = d["steps"]
    # Every prompt token is prefilled once and every output token after the first is one decode
    # row; no step holds more than the token budget.
    assert sum(s["prefill_tokens"] for s in steps) == 6 * 40
    assert sum(s["decode_rows"] for s in steps) == 6 * 11
    assert all(s["prefill_tokens"] + s["decode_rows"] <= 64 for s in steps)
    assert steps[0]["decode_rows"] == 0 and steps[0]["prefill_tokens"] == 64
    assert sorted(d["profiles"]) == ["1", "9"] and [s["index"] for s in steps] == list(
        range(len(steps))
    )
    assert d["prefill_steps"] + d["decode_only_steps"] + 2 == len(steps)


def test_bench_startup_cpu_smoke(tmp_path):
    # One cold start of a demo model on the CPU: ready, and its phases read back from the log
    # (the CPU has no kernels to compile or graphs to capture).
    model = _demo_model()
    out = tmp_path / "startup.json"
    _run(
        ["load_tests/bench_startup.py", "--model-dir", str(model), "--runs", "cold"]
        + ["--timeout", "300", "--work-dir", str(tmp_path / "work"), "--out", str(out)]
        + ["--", "--device", "cpu", "--num-kv-blocks", "64"],
    )
    d = json.loads(out.read_text())
    (run,) = d["runs"]
    assert run["kind"] == "cold" and run["ready_s"] > 0 and "error" not in run
    assert set(run["phases_s"]) == {"loading weights", "sizing the KV cache"}
    assert run["engine_ready_s"] is not None and run["engine_ready_s"] <= run["ready_s"]
    assert d["summary"]["cold_ready_s"] == run["ready_s"]
    assert run["cache_entries"] == 0  # nothing compiled on the CPU


def test_bench_spec_hybrid_mtp_smoke(tmp_path):
    """bench_spec on a hybrid target (Gated DeltaNet layers, fp32 on the CPU): a perfect oracle
    (p = 0) has every proposal accepted through the verify steps' state rollback, and the
    target's own MTP layer (random, written into the folder once) proposes k tokens a step;
    n-gram, draft model and EAGLE left out."""
    out = tmp_path / "spec.json"
    model = tmp_path / "model"
    args = ["load_tests/bench_spec.py", "--preset", "tiny-hybrid", "--device", "cpu"]
    args += ["--model-dir", str(model), "--prompt-len", "24", "--output-len", "10"]
    args += ["--cost-ks", "3", "--oracle-ks", "3", "--corrupt", "0", "--batch-sizes", "1"]
    args += ["--ngram-k", "0", "--draft-preset", "none", "--eagle-k", "0", "--mtp-k", "2"]
    _run(args + ["--out", str(out)])
    r = json.loads(out.read_text())
    assert r["errors"] == {}
    assert "ngram_batch1" not in r and "draft_model_batch1" not in r and "eagle_batch1" not in r
    forced = r["forced_acceptance_batch1"]["k3_p0.0"]
    assert forced["acceptance_rate"] == 1.0, forced
    m = r["mtp_batch1"]
    assert m["num_drafts"] > 0 and m["decode_tok_s"] > 0
    assert json.loads((model / "config.json").read_text())["mtp_num_hidden_layers"] == 1


def test_bench_spec_smoke(tmp_path, monkeypatch):
    """bench_spec end to end at a tiny size: every section written; a perfect oracle (p = 0,
    fp32 on the CPU) has every proposal accepted, at a k above the n-gram engine's (an engine
    per k); the draft preset is Llama-3.2-1B's shape; each speculative figure says whether its
    verify steps ran in graphs (none on the CPU); the temporary checkpoint and the EAGLE head
    beside it are removed at the end."""
    import tempfile

    bench_spec = importlib.import_module("load_tests.bench_spec")
    cfg = common.make_hf_config("llama3.2-1b")
    assert common.weight_bytes(cfg, common.torch.float16)["total_bytes"] == 2 * 1_235_814_400
    a, b = tmp_path / "a", tmp_path / "b"
    assert bench_spec.default_eagle_dir("tiny", a, 0) != bench_spec.default_eagle_dir("tiny", b, 0)
    assert bench_spec.default_eagle_dir("tiny", a, 0) != bench_spec.default_eagle_dir("tiny", a, 1)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    out = tmp_path / "spec.json"
    args = ["load_tests/bench_spec.py", "--preset", "tiny", "--device", "cpu"]
    args += ["--prompt-len", "32", "--output-len", "10", "--cost-ks", "4"]
    args += ["--oracle-ks", "2", "--corrupt", "0", "--batch-sizes", "1,2"]
    args += ["--draft-preset", "tiny", "--draft-dir", str(tmp_path / "draft"), "--out", str(out)]
    _run(args)
    assert list(tmp.iterdir()) == []
    r = json.loads(out.read_text())
    assert r["errors"] == {}
    assert all(rel["engines_alive"] == 0 for rel in r["released"].values()), r["released"]
    for key in ("spec_off", "ngram_batch1", "cost_curve", "forced_acceptance_batch1"):
        assert r[key], key
    # n-gram on P + C + P (11 + 10 + 11 tokens), C compared with the output.
    ng = r["ngram_batch1"]
    assert set(ng["output_vs_continuation"]) == {"equal", "common_prefix"}
    assert r["spec_off_ngram_prompt_batch1"]["decode_tok_s"] > 0
    assert set(r["cost_curve"]) == {"B1_k4", "B2_k4"}
    forced = r["forced_acceptance_batch1"]["k2_p0.0"]
    assert forced["num_drafts"] > 0 and forced["acceptance_rate"] == 1.0
    assert forced["intended_token_acceptance"] == 1.0 and forced["output_equals_recording"]
    assert r["cost_curve"]["B2_k4"]["acceptance_rate"] == 1.0
    assert r["draft_model_batch1"]["num_drafts"] > 0
    for fig in (forced, r["cost_curve"]["B2_k4"], r["ngram_batch1"], r["eagle_batch1"]):
        assert fig["verify_in_graphs"] is False and fig["graphs"]["verify_graph"] == 0


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid", "tiny-hybrid-moe"])
def test_bench_decode_serves_a_quantized_folder_as_it_is(tmp_path, preset):
    """An AWQ folder given as --model-dir is served, not overwritten by a random fp16
    checkpoint, and its floor counts the bytes it stores (codes, scales, zeros, fp16 lm_head).
    The hybrids: their Gated DeltaNet projections quantized too, their floor with the recurrent
    state of their 3 GDN layers and the KV of their one full-attention layer. The MoE hybrid
    (Qwen3.5-35B-A3B's kind): its routed experts written one by one and quantized, the router
    float, a token's floor with 2 of each layer's 8 experts; MTP layers added to the folder
    (write_random_mtp, experts one by one too) leave the decode floor as it was."""
    src, awq, out = tmp_path / "fp16", tmp_path / "awq", tmp_path / "decode.json"
    _run(["load_tests/common.py", "make-checkpoint", "--preset", preset, "--out", str(src)])
    _run(
        ["load_tests/make_awq_checkpoint.py", "--src", str(src), "--out", str(awq), "--group", "32"]
    )
    args = ["--preset", preset, "--device", "cpu", "--prompt-len", "8", "--output-len", "3"]
    args += ["--runs", "1", "--warmup", "0", "--bandwidth-bytes", str(1 << 20)]
    _run(["load_tests/bench_decode.py", *args, "--model-dir", str(src), "--out", str(out)])
    fp16 = json.loads(out.read_text())["model"]["read_per_token_bytes"]
    _run(
        ["load_tests/bench_decode.py", *args, "--model-dir", str(awq), "--skip-transformers"]
        + ["--out", str(out)]
    )
    d = json.loads(out.read_text())
    assert d["errors"] == {} and d["model"]["quantized"] is True
    assert "checkpoint_write_s" not in d
    assert "quantization_config" in json.loads((awq / "config.json").read_text())
    # int4 g32 layers (~0.3 of fp16's bytes) beside the fp16 lm_head: well under fp16.
    assert 0 < d["model"]["read_per_token_bytes"] < 0.8 * fp16
    assert d["engine"]["decode_tok_s"] > 0
    if preset == "tiny":
        return
    from safetensors import safe_open

    with safe_open(str(awq / "model.safetensors"), "pt") as st:
        stored = {name: st.get_tensor(name) for name in st.keys()}  # noqa: SIM118
    assert "model.layers.0.linear_attn.in_proj_qkv.qweight" in stored
    nbytes = {name: t.numel() * t.element_size() for name, t in stored.items()}
    assert d["model"]["kv_layers"] == 1 and d["model"]["layers"] == 4
    # the conv state in the run dtype: fp32 on the CPU
    state = 3 * (8 * 16 * 16 * 4 + (2 * 4 * 16 + 8 * 16) * 3 * 4)
    assert d["model"]["state_bytes_per_sequence"] == state
    assert d["floor"]["state_read_write_bytes"] == 2 * state
    if preset == "tiny-hybrid":
        return
    with safe_open(str(src / "model.safetensors"), "pt") as st:
        assert st.get_slice("model.layers.3.mlp.experts.7.down_proj.weight").get_shape() == [64, 32]
        assert "model.layers.3.mlp.experts.down_proj" not in set(st.keys())  # not stacked
    assert "model.layers.3.mlp.experts.7.up_proj.qweight" in stored
    assert "model.layers.3.mlp.gate.weight" in stored  # the router stays float
    experts = sum(b for n, b in nbytes.items() if ".mlp.experts." in n)
    embed = nbytes["model.embed_tokens.weight"]
    m = d["model"]
    assert (m["num_experts"], m["experts_per_token"], m["routed_expert_bytes"]) == (8, 2, experts)
    assert m["read_per_token_bytes"] == sum(nbytes.values()) - embed - experts * 6 // 8
    cfg = common.make_hf_config(preset)
    assert common.write_random_mtp(awq, cfg, "cpu", common.torch.float16)
    with safe_open(str(awq / "mtp.safetensors"), "pt") as st:
        assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in set(st.keys())
    with_mtp = common.checkpoint_read_bytes(awq)
    assert with_mtp["mtp_bytes"] > 0
    assert with_mtp["read_per_token_bytes"] == m["read_per_token_bytes"]


def test_profile_kernels_prefill_cpu_smoke(tmp_path):
    """profile_kernels.py --prefill --host-profile runs lone prefill steps end to end (on the CPU
    only its host side means anything: no kernels are recorded) and reports the host functions
    with the most time."""
    out = tmp_path / "prefill.json"
    _run(
        [
            "load_tests/profile_kernels.py",
            "--model-dir",
            str(_demo_model()),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prefill",
            "--host-profile",
            "--prompt-len",
            "64",
            "--warm-steps",
            "1",
            "--steps",
            "3",
            "--top",
            "40",
            "--out",
            str(out),
        ]
    )
    r = json.loads(out.read_text())["prefill"]
    assert r["prompt_len"] == 64 and r["steps"] == 3
    assert r["wall_ms_per_step"] > 0
    assert r["kernels"] == [] and r["busy_ms_per_step"] == 0
    fns = r["host_functions"]
    assert 0 < len(fns) <= 40
    assert all(f["own_ms_per_step"] >= 0 and f["calls_per_step"] > 0 for f in fns)
