"""Writes compose/grafana/dashboards/voltserve.json, the provisioned Grafana dashboard.

    .venv/bin/python compose/grafana/make_dashboard.py

The JSON is committed; tests/ops checks it is what this script writes and that every metric it
queries is one voltserve exposes.

Deduplication: engine metrics appear twice in Prometheus, once from each executor's own /metrics
and once from the gateway (which reads every executor's status from Redis at scrape time). Both
carry the same engine label, so every engine query aggregates with `max by (engine)` first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "dashboards" / "voltserve.json"
DS = {"type": "prometheus", "uid": "prometheus"}
SEL = '{model_name=~"$model"}'
WIN = "$__rate_interval"


def per_engine_rate(metric: str) -> str:
    return f"max by (engine) (rate({metric}{SEL}[{WIN}]))"


def total_rate(metric: str) -> str:
    return f"sum({per_engine_rate(metric)})"


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{SEL}[{WIN}])))"


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}


def timeseries(
    pid: int, title: str, desc: str, x: int, y: int, targets: list[tuple[str, str]], unit: str
) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10}},
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        },
        "targets": [target(e, leg, chr(ord("A") + i)) for i, (e, leg) in enumerate(targets)],
    }


def stat(pid: int, title: str, x: int, expr: str, unit: str) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "stat",
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 4, "w": 4, "x": x, "y": 0},
        "fieldConfig": {"defaults": {"unit": unit, "decimals": 2}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "graphMode": "area"},
        "targets": [target(expr, title, "A")],
    }


def percentiles(metric: str) -> list[tuple[str, str]]:
    return [(quantile(q, metric), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


def hit_rate(by_engine: bool) -> str:
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    if by_engine:
        return f"{per_engine_rate(hits)} / clamp_min({per_engine_rate(queries)}, 1e-9)"
    return f"{total_rate(hits)} / clamp_min({total_rate(queries)}, 1e-9)"


def panels() -> list[dict[str, Any]]:
    running = f"max by (engine) (vllm:num_requests_running{SEL})"
    waiting = f"max by (engine) (vllm:num_requests_waiting{SEL})"
    kv = f"max by (engine) (vllm:kv_cache_usage_perc{SEL})"
    out = [
        stat(1, "Generation tokens/s", 0, total_rate("vllm:generation_tokens_total"), "short"),
        stat(2, "Requests/s", 4, f"sum(rate(vllm:request_success_total{SEL}[{WIN}]))", "reqps"),
        stat(3, "TTFT p90", 8, quantile(0.9, "vllm:time_to_first_token_seconds"), "s"),
        stat(4, "ITL p90", 12, quantile(0.9, "vllm:inter_token_latency_seconds"), "s"),
        stat(5, "Waiting", 16, f"sum({waiting})", "short"),
        stat(6, "KV cache usage (max)", 20, f"max({kv})", "percentunit"),
        timeseries(
            10,
            "Token throughput",
            "Prompt tokens computed and tokens generated per second, all executors.",
            0,
            4,
            [
                (total_rate("vllm:generation_tokens_total"), "generation"),
                (total_rate("vllm:prompt_tokens_total"), "prompt"),
            ],
            "short",
        ),
        timeseries(
            11,
            "Generation throughput per executor",
            "Tokens generated per second by each executor.",
            12,
            4,
            [(per_engine_rate("vllm:generation_tokens_total"), "{{engine}}")],
            "short",
        ),
        timeseries(
            12,
            "Time to first token",
            "From the gateway receiving the request to the first token, percentiles.",
            0,
            12,
            percentiles("vllm:time_to_first_token_seconds"),
            "s",
        ),
        timeseries(
            13,
            "Inter-token latency",
            "Gap between successive tokens of a request, percentiles.",
            12,
            12,
            percentiles("vllm:inter_token_latency_seconds"),
            "s",
        ),
        timeseries(
            14,
            "End-to-end request latency",
            "From the gateway receiving the request to its last token, percentiles.",
            0,
            20,
            percentiles("vllm:e2e_request_latency_seconds"),
            "s",
        ),
        timeseries(
            15,
            "Queue time",
            "Time before a request's first engine step, percentiles.",
            12,
            20,
            percentiles("vllm:request_queue_time_seconds"),
            "s",
        ),
        timeseries(
            16,
            "Running and waiting requests per executor",
            "Requests in the executor's batch and in its waiting queue.",
            0,
            28,
            [(running, "running {{engine}}"), (waiting, "waiting {{engine}}")],
            "short",
        ),
        timeseries(
            17,
            "KV cache usage per executor",
            "Fraction of KV blocks held by requests.",
            12,
            28,
            [(kv, "{{engine}}")],
            "percentunit",
        ),
        timeseries(
            18,
            "Preemptions per executor",
            "Requests preempted per second (KV blocks ran out; they are recomputed later).",
            0,
            36,
            [(per_engine_rate("vllm:num_preemptions_total"), "{{engine}}")],
            "short",
        ),
        timeseries(
            19,
            "Prefix cache hit rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up.",
            12,
            36,
            [(hit_rate(False), "all"), (hit_rate(True), "{{engine}}")],
            "percentunit",
        ),
        timeseries(
            20,
            "Finished requests by reason",
            "stop: EOS or a stop string/token; length: max_tokens or context; abort: cancelled.",
            0,
            44,
            [
                (
                    f"sum by (finished_reason) (rate(vllm:request_success_total{SEL}[{WIN}]))",
                    "{{finished_reason}}",
                ),
                (
                    f"sum by (status) (rate(voltserve:request_errors_total{SEL}[{WIN}]))",
                    "error {{status}}",
                ),
            ],
            "reqps",
        ),
        timeseries(
            21,
            "Request lengths",
            "Median prompt and generation tokens per request.",
            12,
            44,
            [
                (quantile(0.5, "vllm:request_prompt_tokens"), "prompt p50"),
                (quantile(0.5, "vllm:request_generation_tokens"), "generation p50"),
            ],
            "short",
        ),
    ]
    return out


def dashboard() -> dict[str, Any]:
    return {
        "uid": "voltserve",
        "title": "voltserve",
        "description": "voltserve serving: throughput, latency percentiles, queue, KV cache, "
        "preemptions and prefix-cache hits, per executor.",
        "tags": ["voltserve", "vllm", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "model",
                    "label": "model",
                    "type": "query",
                    "datasource": DS,
                    "query": {
                        "query": "label_values(vllm:num_requests_running, model_name)",
                        "refId": "model",
                    },
                    "definition": "label_values(vllm:num_requests_running, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"selected": True, "text": "All", "value": "$__all"},
                    "refresh": 2,
                }
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
