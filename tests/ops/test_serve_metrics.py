"""`voltserve serve` end to end: what one scrape of the gateway's /metrics says equals what was
sent. Random prompts and budgets each run; real services, real (embedded) valkey, demo model."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from load_tests.serve_stack import (  # noqa: E402
    ServeStack,
    executor_statuses,
    http_json,
    metric_sum,
    scrape,
)

WORDS = "alpha beta gamma delta volta kernel token cache block stream river stone".split()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    from voltserve.services.executor.demo_model import main as make_demo_model

    work = tmp_path_factory.mktemp("serve")
    # `voltserve make-demo-model` in this process (serve_stack.ensure_demo_model runs it as a
    # subprocess, which would import torch and transformers once more).
    model = work / "demo"
    make_demo_model([str(model)])
    extra = ["--device", "cpu", "--num-kv-blocks", "96", "--max-num-seqs", "8"]
    with ServeStack(model, work, extra, start_timeout_s=180) as s:
        yield s


def complete(stack: ServeStack, rng: random.Random, **kw) -> dict:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body = {"model": stack.model_name, "prompt": words, "temperature": 0.0, **kw}
    status, data = http_json(stack.url + "/v1/completions", body, timeout=60)
    assert status == 200, data
    return data


def wait_for(pred, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(pred.url)
        if pred(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.3)


def test_health_and_models_only_when_ready(stack: ServeStack) -> None:
    assert http_json(stack.url + "/health")[0] == 200
    assert [m["id"] for m in http_json(stack.url + "/v1/models")[1]["data"]] == [stack.model_name]


def test_metrics_match_what_was_sent(rng, stack: ServeStack) -> None:
    before = scrape(stack.url)

    def total(m, name, **lab):
        return metric_sum(m, name, **lab) - metric_sum(before, name, **lab)

    # Length-bound requests: every counter is exact.
    n_len = rng.randint(4, 8)
    prompt_tokens = gen_tokens = 0
    for _ in range(n_len):
        d = complete(stack, rng, max_tokens=rng.randint(2, 12), ignore_eos=True)
        assert d["choices"][0]["finish_reason"] == "length"
        prompt_tokens += d["usage"]["prompt_tokens"]
        gen_tokens += d["usage"]["completion_tokens"]
    # Requests ended by a stop string the output is sure to contain: its own first character.
    n_stop = stop_prompt_tokens = 0
    for _ in range(rng.randint(2, 4)):
        probe = complete(stack, rng, max_tokens=8, seed=1, ignore_eos=True)
        text = probe["choices"][0]["text"]
        if len(text.strip()) < 2:
            continue
        stop_char = text.strip()[1]
        d = complete(stack, rng, max_tokens=8, seed=1, ignore_eos=True, stop=[stop_char])
        if d["choices"][0]["finish_reason"] == "stop":
            n_stop += 1
            stop_prompt_tokens += d["usage"]["prompt_tokens"]
        # The probe itself counts as a length request.
        n_len += 1
        prompt_tokens += probe["usage"]["prompt_tokens"]
        gen_tokens += probe["usage"]["completion_tokens"]
        if d["choices"][0]["finish_reason"] == "length":
            n_len += 1
            prompt_tokens += d["usage"]["prompt_tokens"]
            gen_tokens += d["usage"]["completion_tokens"]

    def settled(m):
        return (
            total(m, "vllm:request_success_total") == n_len + n_stop
            and metric_sum(m, "vllm:num_requests_running") == 0
            and metric_sum(m, "vllm:num_requests_waiting") == 0
            and metric_sum(m, "vllm:kv_cache_usage_perc") == 0
            and total(m, "vllm:request_queue_time_seconds_count") == n_len + n_stop
        )

    settled.url = stack.url
    m = wait_for(settled)
    assert total(m, "vllm:request_success_total", finished_reason="length") == n_len
    assert total(m, "vllm:request_success_total", finished_reason="stop") == n_stop
    n = n_len + n_stop
    assert total(m, "vllm:time_to_first_token_seconds_count") == n
    assert total(m, "vllm:e2e_request_latency_seconds_count") == n
    assert total(m, "vllm:request_queue_time_seconds_count") == n
    # Gauges are back to idle once the heartbeat catches up.
    assert metric_sum(m, "vllm:num_requests_running") == 0
    assert metric_sum(m, "vllm:num_requests_waiting") == 0
    assert metric_sum(m, "vllm:kv_cache_usage_perc") == 0
    # Length requests: the gateway's histograms count exactly what the client was told.
    if n_stop == 0:
        assert total(m, "vllm:request_prompt_tokens_sum") == prompt_tokens
        assert total(m, "vllm:request_generation_tokens_sum") == gen_tokens
        assert total(m, "vllm:generation_tokens_total") == gen_tokens
        # Engine prompt tokens exclude prefix-cache hits.
        hits = total(m, "vllm:prefix_cache_hits_total")
        assert total(m, "vllm:prompt_tokens_total") + hits == prompt_tokens
        assert total(m, "vllm:inter_token_latency_seconds_count") == gen_tokens - n
    else:
        all_prompt = prompt_tokens + stop_prompt_tokens
        assert total(m, "vllm:request_prompt_tokens_sum") == all_prompt
        assert total(m, "vllm:generation_tokens_total") >= gen_tokens
    # Every KV block is free in every executor's status hash.
    for eid, h in executor_statuses(stack.redis_url).items():
        assert h["num_free_blocks"] == h["num_total_blocks"], (eid, h)


def test_client_disconnect_counts_as_abort(rng, stack: ServeStack) -> None:
    """A client that drops its stream is counted as finished_reason="abort" (vLLM's meaning), not
    as "length"/"stop"; its KV blocks are freed; the gateway logs no traceback for it."""
    import http.client
    import json
    import socket
    import struct
    from urllib.parse import urlsplit

    before = scrape(stack.url)
    log_before = stack.log_path.stat().st_size

    def total(m, name, **lab):
        return metric_sum(m, name, **lab) - metric_sum(before, name, **lab)

    n_drop = rng.randint(3, 6)
    u = urlsplit(stack.url)
    conns = []
    for _ in range(n_drop):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))
        body = {
            "model": stack.model_name,
            "prompt": words,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        conns.append(conn)
    for conn in conns:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # tokens flow: the request runs
    for conn in conns:
        # The client goes away mid-stream with a reset, while the gateway is writing to it.
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.sock.close()
        conn.close()

    def settled(m):
        return (
            total(m, "vllm:request_success_total", finished_reason="abort") >= n_drop
            and metric_sum(m, "vllm:num_requests_running") == 0
            and metric_sum(m, "vllm:kv_cache_usage_perc") == 0
        )

    settled.url = stack.url
    m = wait_for(settled)
    assert total(m, "vllm:request_success_total", finished_reason="abort") == n_drop
    assert total(m, "vllm:request_success_total", finished_reason="length") == 0
    assert total(m, "vllm:request_success_total", finished_reason="stop") == 0
    assert metric_sum(m, "vllm:num_requests_running") == 0
    assert metric_sum(m, "vllm:kv_cache_usage_perc") == 0
    # Freed by the aborts, long before 400 tokens each.
    assert total(m, "vllm:generation_tokens_total") < 400 * n_drop
    with open(stack.log_path, "rb") as f:
        f.seek(log_before)
        new_log = f.read().decode(errors="replace")
    assert "Traceback" not in new_log and "ClientConnectionResetError" not in new_log, new_log
