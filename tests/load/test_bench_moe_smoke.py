"""CPU smoke of load_tests/bench_moe.py: the whole script at a tiny shape (2 layers, 8 experts,
top-2) with its int4 (AWQ) run, its JSON keys, the engine's greedy tokens against transformers
on the same weights, and the floors' byte counts (fp16 and int4 g128) at the real Qwen3-30B-A3B
shape. Timings are not checked. The script runs in this process, through its main(argv): a
subprocess would import torch and transformers again."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from load_tests import bench_moe  # noqa: E402
from tests.load.scripts import run_main  # noqa: E402


def test_floor_bytes_at_qwen3_30b_a3b():
    cfg = bench_moe.make_config(48, torch.float16)
    b = bench_moe.bytes_read(cfg, torch.float16, 48, 8)
    # 8 routed experts of 3 x 2048 x 768 per layer, attention 2048 x (4096 + 2 x 512) + 4096 x
    # 2048, the router 128 x 2048, the lm_head 151936 x 2048: the model's 3.3B active parameters
    # less the embedding (a row gather, 151936 x 2048 = 0.31B).
    params = b["total"] / 2
    assert 3.0e9 < params < 3.1e9 and 3.3e9 < params + 151936 * 2048 < 3.4e9
    assert b["expert_bytes"] == 2 * 3 * 2048 * 768
    assert abs(bench_moe.distinct_experts(128, 8, 256) - 128) < 1e-3
    # int4 g128 as the engine holds it: per weight element half a byte of codes, and an fp16
    # scale and offset per 128 elements; attention, router, norms and lm_head stay fp16.
    q = bench_moe.int4_bytes_read(cfg, torch.float16, 48, 8, 128, "experts")
    assert q["expert_bytes"] == 3 * 2048 * 768 * (1 / 2 + 4 / 128)
    assert q["total"] == b["total"] - 48 * 8 * (b["expert_bytes"] - q["expert_bytes"])
    assert 1.77 < b["total"] / q["total"] < 1.78  # the docstring's floor ratios: 48 layers
    c8 = bench_moe.make_config(8, torch.float16)
    b8 = bench_moe.bytes_read(c8, torch.float16, 8, 8)["total"]
    q8 = bench_moe.int4_bytes_read(c8, torch.float16, 8, 8, 128, "experts")["total"]
    assert 1.40 < b8 / q8 < 1.42  # and 8 layers
    a = bench_moe.int4_bytes_read(cfg, torch.float16, 48, 8, 128, "all")
    attn = 2048 * (4096 + 2 * 512) + 4096 * 2048
    int4_attn = attn * (1 / 2 + 4 / 128)  # --int4-modules all: attention packed too
    assert q["attention_per_layer"] - a["attention_per_layer"] == 2 * attn - int4_attn


def test_bench_moe_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "moe.json"
    args = ["--shape", "tiny", "--layers", "2", "--device", "cpu"]
    args += ["--dtype", "float32", "--prompt-len", "8", "--output-len", "5", "--runs", "1"]
    args += ["--warmup", "0", "--hf-runs", "1", "--hf-warmup", "0", "--batch-sizes", "4"]
    args += ["--context", "8", "--decode-steps", "2", "--decode-warmup", "1"]
    args += ["--max-num-batched-tokens", "64", "--bandwidth-bytes", str(1 << 20)]
    # then int4 experts (AWQ g16: the tiny experts' K is 32 and 64) in the same run
    args += ["--quantization", "awq", "--group-size", "16"]
    args += ["--out", str(out)]
    run_main("bench_moe", args)
    res = json.loads(out.read_text())
    assert not res["errors"], res["errors"]
    assert res["engine"]["decode_tok_s"] > 0 and res["transformers"]["decode_tok_s"] > 0
    assert res["greedy_agreement_tokens"] == 5  # fp32 on CPU: token for token
    assert res["floor"]["tok_s"] > 0 and res["batched"][0]["batch_size"] == 4
    q = res["int4"]
    # the AWQ folder holds packed experts (the floor's count of their bytes is checked against
    # the loaded layers by the script: an error above otherwise) and fp16 attention
    assert q["checkpoint"]["skip"] == ["self_attn"] and not q["checkpoint"]["reused"]
    assert not Path(q["checkpoint_dir"]).exists()  # written next to the temporary fp16 one
    assert q["loaded_expert_bytes"] == q["floor"]["bytes_per_token"]["expert_bytes"]
    fp16_attn = res["floor"]["bytes_per_token"]["attention_per_layer"]
    assert q["floor"]["bytes_per_token"]["attention_per_layer"] == fp16_attn
    assert q["floor_speedup_vs_fp16"] > 1 and q["floor"]["full_model_speedup_vs_fp16"] > 1
    assert q["engine"]["decode_tok_s"] > 0 and q["speedup_vs_fp16"] > 0
    assert q["fused_int4_decode_layers"] == "0/2"  # CUDA kernels: the CPU dequantizes
    assert q["batched"][0]["batch_size"] == 4 and set(q["batched_speedup_vs_fp16"]) == {"4"}
