"""CI smoke of load_tests/bench_gateway_stream.py: the real gateway, renderer, scheduler and a
synthetic executor at a small size. Checks the JSON keys and that every token reached its client
exactly once, in order (the streamed text equals the text of the tokens the executor drew for
that request's seed). Timings are not checked: a shared CPU box says nothing about them.

The script runs in this process, through its main(argv) (a subprocess would import torch and
transformers again); the services it starts are processes of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.load.scripts import run_main

KEYS = {
    "clients",
    "completed",
    "failed",
    "total_output_tokens",
    "delivered_tokens_per_s",
    "steady_tokens_per_s",
    "step_interval_ms",
    "tokens_per_chunk",
    "p50_itl_ms",
    "p99_itl_ms",
    "cpu_percent",
    "tokens_per_cpu_s",
    "exact",
    "bad",
}


@pytest.mark.slow  # the benchmark end to end: scheduled first
def test_gateway_stream_bench_smoke(rng, tmp_path: Path) -> None:
    clients, output_len = rng.randint(6, 12), rng.randint(8, 24)
    api = rng.choice(["completions", "chat"])
    out = tmp_path / "stream.json"
    argv = [
        "--clients",
        str(clients),
        "--output-len",
        str(output_len),
        "--step-ms",
        "10",
        "--api",
        api,
        "--vocab-size",
        "512",
        "--warmup",
        "1",
        "--seed",
        str(rng.randrange(1 << 20)),
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    run_main("bench_gateway_stream", argv)
    m = json.loads(out.read_text())["metrics"]
    assert KEYS <= set(m), KEYS - set(m)
    assert m["bad"] == [], m["bad"]
    assert m["completed"] == m["exact"] == clients and m["failed"] == 0
    assert m["total_output_tokens"] == clients * output_len
    assert {"gateway", "scheduler", "executor", "client"} <= set(m["cpu_percent"])
