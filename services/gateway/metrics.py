"""Every metric the gateway exports, on one registry per app (vLLM's names, from shared/metrics).

- request metrics (TTFT, ITL, e2e, token counts, success by finish reason) observed here;
- every executor's engine gauges and counters, read from their status hashes at scrape time;
- the gateway's own HTTP request counter.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from voltserve.shared.metrics import (
    ExecutorCollector,
    RequestMetrics,
    StatusSnapshot,
    read_executor_statuses,
)


class GatewayMetrics:
    def __init__(self, model_name: str, max_model_len: int = 131072) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.requests = RequestMetrics(self.registry, max_model_len)
        self.executors = StatusSnapshot()
        self.registry.register(ExecutorCollector(self.executors, model_name))
        self.http_requests = Counter(
            "voltserve:http_requests",
            "HTTP requests answered by the gateway, by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )

    async def render(self, redis: Any) -> tuple[bytes, str]:
        self.executors.set(await read_executor_statuses(redis))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
