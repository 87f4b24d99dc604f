"""Prometheus metrics with vLLM's names and labels, so dashboards, autoscalers and llm-d's endpoint
picker read voltserve unchanged.

Two halves:

- Engine state (gauges and engine counters) lives in each executor's status hash in Redis (see
  STATUS_FIELDS). `ExecutorCollector` turns those hashes into metrics on every scrape, labelled
  engine=<executor id>, so one scrape of the gateway shows every executor. The executor's own
  /metrics uses the same collector, handed a snapshot of itself.
- Request-level metrics (TTFT, inter-token latency, end-to-end latency, token histograms,
  success by finish reason) are observed by the gateway, which sees every token of every
  request: `RequestMetrics` and `RequestTimer`. Queue time is the exception: only the executor
  knows when a request's first step ran, so it keeps that histogram (`StatusHistogram`) and
  carries it in its status hash like the gauges.

Every metric lives in a CollectorRegistry the caller passes in; nothing touches prometheus_client's
global registry, so tests and several services in one process never collide.

Counter names are given without the "_total" suffix: prometheus_client appends it, so the counter
"vllm:prompt_tokens" is exposed as vllm:prompt_tokens_total.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

LABELS = ("model_name", "engine")

# vLLM's bucket boundaries (seconds), so histogram_quantile over mixed fleets lines up.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort")


def token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


# --------------------------------------------------------------------------------------------
# Engine state: the executor status hash and the collector that exposes it.
# --------------------------------------------------------------------------------------------

# Fields every executor status hash must carry (the engine's EngineStats, written by the
# executor's heartbeat), plus "model" (served model name) and "executor_id".
# hash field -> (metric name, kind, help). kind: "gauge" or "counter".
STATUS_FIELDS: dict[str, tuple[str, str, str]] = {
    "num_running": (
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
    ),
    "num_waiting": (
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
    ),
    "kv_cache_usage": (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
    ),
    "num_preemptions_total": (
        "vllm:num_preemptions",
        "counter",
        "Cumulative number of preemptions from the engine.",
    ),
    "prompt_tokens_total": (
        "vllm:prompt_tokens",
        "counter",
        "Number of prefill tokens processed.",
    ),
    "generation_tokens_total": (
        "vllm:generation_tokens",
        "counter",
        "Number of generation tokens processed.",
    ),
    "prefix_cache_queries": (
        "vllm:prefix_cache_queries",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "prefix_cache_hits": (
        "vllm:prefix_cache_hits",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    # Not a vLLM metric: requests ended with a 500 because the model's logits for them held
    # NaN or infinity (activations that overflowed, usually fp16).
    "nonfinite_requests_total": (
        "voltserve:nonfinite_logits_requests",
        "counter",
        "Requests ended with an error because their logits were not finite (NaN or infinity).",
    ),
}
# Speculative decoding counters (vLLM's names; present in the hash of every executor whose
# EngineStats has them, zero without speculation). The per-position counter is carried as
# fields spec_decode_num_accepted_tokens_per_pos_{i} and exposed with label "position".
SPEC_STATUS_FIELDS: dict[str, tuple[str, str, str]] = {
    "spec_decode_num_drafts": (
        "vllm:spec_decode_num_drafts",
        "counter",
        "Number of spec decoding drafts.",
    ),
    "spec_decode_num_draft_tokens": (
        "vllm:spec_decode_num_draft_tokens",
        "counter",
        "Number of draft tokens.",
    ),
    "spec_decode_num_accepted_tokens": (
        "vllm:spec_decode_num_accepted_tokens",
        "counter",
        "Number of accepted tokens.",
    ),
}
SPEC_PER_POS_FIELD = "spec_decode_num_accepted_tokens_per_pos"
SPEC_PER_POS_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"
# Also required in the hash (not exposed as vLLM metrics, used by ops checks and the scheduler).
BLOCK_FIELDS = ("num_free_blocks", "num_total_blocks")
REQUIRED_STATUS_FIELDS = ("executor_id", "model", *STATUS_FIELDS, *BLOCK_FIELDS)


def stats_to_status(stats: Any) -> dict[str, int | float]:
    """An EngineStats (any dataclass with the fields above) -> status-hash fields (every field of
    the dataclass, numbers only). The executor's heartbeat writes these into its status hash."""
    d = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)
    out: dict[str, int | float] = {}
    for k, v in d.items():
        if isinstance(v, bool):
            out[k] = int(v)
        elif isinstance(v, int | float):
            out[k] = v
        elif isinstance(v, tuple | list):  # a per-index counter: one field per index
            for i, x in enumerate(v):
                if isinstance(x, int | float) and not isinstance(x, bool):
                    out[f"{k}_{i}"] = x
    return out


# Histograms an executor keeps and carries in its status hash, so one gateway scrape shows them.
# prefix -> (metric name, help, buckets)
STATUS_HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "queue_time": (
        "vllm:request_queue_time_seconds",
        "Histogram of time from the request's arrival at the gateway to the start of the engine "
        "step that produced its first token (rendering, scheduling and the executor's waiting "
        "queue).",
        REQUEST_LATENCY_BUCKETS,
    ),
}


class StatusHistogram:
    """A cumulative histogram that lives in an executor and travels in its status hash as fields
    {prefix}_count, {prefix}_sum and {prefix}_le_{bound}. Written by one thread (the engine loop),
    read by the heartbeat: a read may lag by one observation, never tear a field."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.bounds = STATUS_HISTOGRAMS[prefix][2]
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1
                break
        self.count += 1
        self.sum += value

    def to_status(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            f"{self.prefix}_count": self.count,
            f"{self.prefix}_sum": self.sum,
        }
        acc = 0
        for b, c in zip(self.bounds, list(self.counts)):
            acc += c
            out[f"{self.prefix}_le_{b}"] = acc
        return out


@dataclass
class ExecutorStatus:
    """One executor's status hash, parsed."""

    executor_id: str
    model_name: str
    values: dict[str, float]

    @classmethod
    def from_hash(cls, h: Mapping[Any, Any], executor_id: str | None = None) -> ExecutorStatus:
        d = {_s(k): _s(v) for k, v in h.items()}
        eid = executor_id or d.get("executor_id") or d.get("id") or "unknown"
        model = d.get("model") or d.get("model_name") or ""
        values: dict[str, float] = {}
        for k, v in d.items():
            try:
                values[k] = float(v)
            except ValueError:
                continue
        if "kv_cache_usage" not in values and values.get("num_total_blocks", 0) > 0:
            total = values["num_total_blocks"]
            values["kv_cache_usage"] = 1.0 - values.get("num_free_blocks", total) / total
        return cls(executor_id=eid, model_name=model, values=values)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class ExecutorCollector(Collector):
    """Exposes every executor's engine gauges and counters, read at scrape time from `source`
    (a callable returning the current ExecutorStatus list: a Redis reader or a snapshot).

    `model_name` overrides the hash's "model" (which may be a checkpoint path) with the served
    model name, so engine and request metrics carry the same label."""

    def __init__(
        self, source: Callable[[], Iterable[ExecutorStatus]], model_name: str | None = None
    ) -> None:
        self._source = source
        self._model_name = model_name

    def _families(self) -> dict[str, Metric]:
        fams: dict[str, Metric] = {}
        for field, (name, kind, help_) in STATUS_FIELDS.items():
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            fams[field] = cls(name, help_, labels=list(LABELS))
        for field, (name, _, help_) in SPEC_STATUS_FIELDS.items():
            fams[field] = CounterMetricFamily(name, help_, labels=list(LABELS))
        fams[SPEC_PER_POS_FIELD] = CounterMetricFamily(
            SPEC_PER_POS_METRIC,
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for prefix, (name, help_, _) in STATUS_HISTOGRAMS.items():
            fams[prefix] = HistogramMetricFamily(name, help_, labels=list(LABELS))
        return fams

    def describe(self) -> Iterator[Metric]:
        # Names only: registration must not read Redis.
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        fams = self._families()
        for st in self._source():
            labels = [self._model_name or st.model_name, st.executor_id]
            for field in (*STATUS_FIELDS, *SPEC_STATUS_FIELDS):
                v = st.values.get(field)
                if v is not None and math.isfinite(v):
                    fams[field].add_metric(labels, v)
            pos = 0
            while (v := st.values.get(f"{SPEC_PER_POS_FIELD}_{pos}")) is not None:
                fams[SPEC_PER_POS_FIELD].add_metric([*labels, str(pos)], v)
                pos += 1
            for prefix, (_, _, bounds) in STATUS_HISTOGRAMS.items():
                count = st.values.get(f"{prefix}_count")
                if count is None:
                    continue
                buckets = [(str(b), st.values.get(f"{prefix}_le_{b}", 0.0)) for b in bounds]
                buckets.append(("+Inf", count))
                fams[prefix].add_metric(labels, buckets, st.values.get(f"{prefix}_sum", 0.0))
        yield from fams.values()


class StatusSnapshot:
    """A source for ExecutorCollector that holds the last statuses it was handed. The gateway
    reads the hashes asynchronously, sets them here, then renders the registry."""

    def __init__(self) -> None:
        self._statuses: list[ExecutorStatus] = []

    def set(self, statuses: Iterable[ExecutorStatus]) -> None:
        self._statuses = list(statuses)

    def __call__(self) -> list[ExecutorStatus]:
        return self._statuses


async def read_executor_statuses(r: Any, alive_only: bool = True) -> list[ExecutorStatus]:
    """Every executor's status hash (redis.asyncio client). With alive_only, executors whose
    heartbeat expired are left out, so a dead executor's gauges vanish instead of going stale."""
    from voltserve.shared import streams

    ids = sorted(_s(x) for x in await r.smembers(streams.executors_key()))
    if not ids:
        return []
    async with r.pipeline(transaction=False) as p:
        for eid in ids:
            p.hgetall(streams.executor_status_key(eid))
            p.exists(streams.executor_alive_key(eid))
        res = await p.execute()
    out = []
    for i, eid in enumerate(ids):
        h, alive = res[2 * i], res[2 * i + 1]
        if h and (alive or not alive_only):
            out.append(ExecutorStatus.from_hash(h, executor_id=eid))
    return out


def executor_self_source(
    executor_id: str, model_name: str, status: Callable[[], Mapping[str, Any] | None]
) -> Callable[[], list[ExecutorStatus]]:
    """A collector source for an executor's own /metrics: the status fields its heartbeat
    writes (see status_fields), read in-process, no Redis."""

    def source() -> list[ExecutorStatus]:
        d = status()
        if not d:
            return []
        return [ExecutorStatus.from_hash(d, executor_id=executor_id)]

    return source


def status_fields(stats: Any, histograms: Iterable[StatusHistogram] = ()) -> dict[str, Any]:
    """Every metric field an executor's status hash carries: its EngineStats plus its
    histograms."""
    out: dict[str, Any] = stats_to_status(stats) if stats is not None else {}
    for h in histograms:
        out.update(h.to_status())
    return out


# --------------------------------------------------------------------------------------------
# Request-level metrics, observed by the gateway.
# --------------------------------------------------------------------------------------------


class RequestMetrics:
    """TTFT, inter-token latency, e2e latency, token counts and success counters. (Queue time is
    measured by the executors, which alone know when a request's first step ran: see
    QueueTimeHistogram.)"""

    def __init__(self, registry: CollectorRegistry, max_model_len: int = 131072) -> None:
        lab = list(LABELS)
        tok = token_buckets(max_model_len)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            lab,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            lab,
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            lab,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            lab,
            buckets=tok,
            registry=registry,
        )
        self.generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            lab,
            buckets=tok,
            registry=registry,
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*lab, "finished_reason"],
            registry=registry,
        )
        # Not a vLLM metric: requests that ended with an error instead of tokens.
        self.errors = Counter(
            "voltserve:request_errors",
            "Requests answered with an error, by HTTP status.",
            ["model_name", "status"],
            registry=registry,
        )

    def observe_finished(self, t: RequestTimer, finished_reason: str, engine: str = "") -> None:
        """Record one finished request (every output of an n>1 request is its own request)."""
        lab = (t.model_name, engine)
        end = t.last_token_time or time.monotonic()
        if t.first_token_time is not None:
            self.ttft.labels(*lab).observe(t.first_token_time - t.arrival_time)
        self.e2e.labels(*lab).observe(end - t.arrival_time)
        self.prompt_tokens.labels(*lab).observe(t.num_prompt_tokens)
        self.generation_tokens.labels(*lab).observe(t.num_generation_tokens)
        # The child is made even with no gaps (a one-token request) so that every series a
        # finished request touches is exposed, at count 0 where nothing was observed, as vLLM's
        # per-engine children are, rather than missing until some request has two tokens.
        itl = self.itl.labels(*lab)
        if t.pending_itl:
            observe_many(itl, t.pending_itl)
        t.pending_itl.clear()
        self.success.labels(*lab, finished_reason).inc()

    def observe_error(self, model_name: str, status: int) -> None:
        self.errors.labels(model_name, str(status)).inc()


class SchedulerMetrics:
    """The scheduler leader's counters (its --metrics-port)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # Not a vLLM metric: the crash-loop guard (services/scheduler/failover.py).
        self.crash_loop_failed = Counter(
            "voltserve:crash_loop_failed_requests",
            "Requests failed with a 500 instead of being placed again: they were in flight at "
            "repeated executor deaths with no output in between (a crash loop).",
            registry=registry,
        )


def observe_many(h: Any, samples: Iterable[tuple[float, int]]) -> None:
    """h.observe(value) `count` times for each (value, count): a request's inter-token gaps at
    its end, one bucket increment per bucket rather than one locked observation per token
    (which was ~8% of a busy gateway's time at 256 streams and 5 ms steps). The bucket of a
    value is the first upper bound >= it, as Histogram.observe picks it. A histogram child
    without the fields this reads gets plain observe calls."""
    bounds = getattr(h, "_upper_bounds", None)
    buckets = getattr(h, "_buckets", None)
    total = getattr(h, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value, count in samples:
            for _ in range(count):
                h.observe(value)
        return
    counts = [0] * len(bounds)
    acc = 0.0
    for value, count in samples:
        if value != value:  # NaN: observe() adds it to the sum and to no bucket
            acc += value
            continue
        counts[bisect.bisect_left(bounds, value)] += count
        acc += value * count
    total.inc(acc)
    for i, c in enumerate(counts):
        if c:
            buckets[i].inc(c)


@dataclass
class RequestTimer:
    """Per-request timing kept by the gateway. Times are time.monotonic() seconds.

    Inter-token latency: a delta carrying k tokens `gap` seconds after the previous one counts as
    k gaps of gap/k, so the histogram holds exactly (generation tokens - 1) samples per request.
    """

    model_name: str
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    pending_itl: list[tuple[float, int]] = dataclasses.field(default_factory=list)

    def on_tokens(self, num_tokens: int, now: float | None = None) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
            if num_tokens > 1:
                # Tokens that arrive together with the first (a resumed or speculative step).
                self.pending_itl.append((0.0, num_tokens - 1))
        else:
            gap = (now - (self.last_token_time or now)) / num_tokens
            self.pending_itl.append((gap, num_tokens))
        self.last_token_time = now
        self.num_generation_tokens += num_tokens


# --------------------------------------------------------------------------------------------
# Rendering and serving.
# --------------------------------------------------------------------------------------------


def metric_names(max_model_len: int = 131072) -> set[str]:
    """Every series base name a voltserve /metrics can expose (counters with _total), for checks
    such as "the dashboard only uses names that exist"."""
    reg = CollectorRegistry()
    RequestMetrics(reg, max_model_len)
    SchedulerMetrics(reg)
    reg.register(ExecutorCollector(lambda: []))
    names: set[str] = set()
    for fam in reg.collect():
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names.update(fam.name + s for s in ("_bucket", "_sum", "_count"))
            names.add(fam.name)
        else:
            names.add(fam.name)
    return names


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> None:
    """Serve `registry` on http://addr:port/metrics from a daemon thread (executor, scheduler,
    renderer: services without their own HTTP server)."""
    from prometheus_client import start_http_server

    start_http_server(port, addr=addr, registry=registry)


def add_metrics_port_flag(p: Any) -> None:
    """--metrics-port for services without their own HTTP server (argparse parser)."""
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port"
    )


def process_registry() -> CollectorRegistry:
    """A registry with this process's CPU, memory, file descriptors and GC metrics."""
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def serve_process_metrics(port: int | None) -> CollectorRegistry | None:
    """Renderer and scheduler: /metrics with the process metrics, when a port is given."""
    if not port:
        return None
    registry = process_registry()
    start_metrics_server(port, registry)
    return registry


def serve_executor_metrics(
    port: int, executor_id: str, model_name: str, status: Callable[[], Mapping[str, Any] | None]
) -> CollectorRegistry:
    """An executor's own /metrics: its engine gauges, counters and queue-time histogram, and
    its process metrics."""
    registry = process_registry()
    registry.register(ExecutorCollector(executor_self_source(executor_id, model_name, status)))
    start_metrics_server(port, registry)
    return registry
