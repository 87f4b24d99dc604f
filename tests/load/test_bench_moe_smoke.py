"""CPU smoke of load_tests/bench_moe.py: the whole script at a tiny shape (2 layers, 8 experts,
top-2), its JSON keys, the engine's greedy tokens against transformers on the same weights, and
the floor's byte count at the real Qwen3-30B-A3B shape. Timings are not checked. The script runs
in this process, through its main(argv): a subprocess would import torch and transformers again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

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


def test_bench_moe_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "moe.json"
    args = ["--shape", "tiny", "--layers", "2", "--device", "cpu"]
    args += ["--dtype", "float32", "--prompt-len", "8", "--output-len", "5", "--runs", "1"]
    args += ["--warmup", "0", "--hf-runs", "1", "--hf-warmup", "0", "--batch-sizes", "4"]
    args += ["--context", "8", "--decode-steps", "2", "--decode-warmup", "1"]
    args += ["--max-num-batched-tokens", "64", "--bandwidth-bytes", str(1 << 20)]
    args += ["--out", str(out)]
    run_main("bench_moe", args)
    res = json.loads(out.read_text())
    assert not res["errors"], res["errors"]
    assert res["engine"]["decode_tok_s"] > 0 and res["transformers"]["decode_tok_s"] > 0
    assert res["greedy_agreement_tokens"] == 5  # fp32 on CPU: token for token
    assert res["floor"]["tok_s"] > 0 and res["batched"][0]["batch_size"] == 4
