"""shared/metrics.py on its own: random executor statuses and request timings in, the exposed
text out, compared value by value."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from voltserve.shared.metrics import (
    STATUS_FIELDS,
    ExecutorCollector,
    ExecutorStatus,
    RequestMetrics,
    RequestTimer,
    StatusHistogram,
    StatusSnapshot,
    metric_names,
    observe_many,
    status_fields,
    token_buckets,
)


def samples(reg: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_collector_exposes_every_executor_hash(rng) -> None:
    reg = CollectorRegistry()
    snap = StatusSnapshot()
    reg.register(ExecutorCollector(snap, model_name="m"))
    hashes = {}
    for i in range(rng.randint(1, 4)):
        h = {f: rng.randint(0, 10_000) for f in STATUS_FIELDS}
        h["kv_cache_usage"] = rng.random()
        hist = StatusHistogram("queue_time")
        qs = [rng.expovariate(1.0) for _ in range(rng.randint(0, 30))]
        for q in qs:
            hist.observe(q)
        raw = {k.encode(): str(v).encode() for k, v in {**h, **hist.to_status()}.items()}
        raw[b"model"] = b"/path/to/ckpt"
        hashes[f"exec-{i}"] = (h, qs, raw)
    snap.set(ExecutorStatus.from_hash(raw, executor_id=eid) for eid, (_, _, raw) in hashes.items())
    got = samples(reg)
    for eid, (h, qs, _) in hashes.items():
        lab = (("engine", eid), ("model_name", "m"))
        for field, (name, kind, _) in STATUS_FIELDS.items():
            key = name + ("_total" if kind == "counter" else "")
            assert abs(got[(key, lab)] - h[field]) < 1e-9, (eid, field)
        assert got[("vllm:request_queue_time_seconds_count", lab)] == len(qs)
        assert abs(got[("vllm:request_queue_time_seconds_sum", lab)] - sum(qs)) < 1e-6
        le1 = got[("vllm:request_queue_time_seconds_bucket", (*lab[:1], ("le", "1.0"), lab[1]))]
        assert le1 == sum(q <= 1.0 for q in qs)


def test_kv_usage_derived_from_blocks_when_missing() -> None:
    st = ExecutorStatus.from_hash({"num_free_blocks": "30", "num_total_blocks": "40"}, "e")
    assert st.values["kv_cache_usage"] == 0.25


def test_request_timer_and_metrics(rng) -> None:
    reg = CollectorRegistry()
    m = RequestMetrics(reg, max_model_len=4096)
    n_tokens_total = 0
    reasons = {"stop": 0, "length": 0}
    for _ in range(rng.randint(1, 10)):
        t = RequestTimer("m", arrival_time=0.0)
        now = rng.random()
        chunks = [rng.randint(1, 3) for _ in range(rng.randint(1, 8))]
        for k in chunks:
            now += rng.random() * 0.1
            t.on_tokens(k, now)
        t.num_prompt_tokens = rng.randint(1, 100)
        reason = rng.choice(list(reasons))
        reasons[reason] += 1
        m.observe_finished(t, reason, "e0")
        n_tokens_total += sum(chunks)
    got = samples(reg)
    lab = (("engine", "e0"), ("model_name", "m"))
    n = sum(reasons.values())
    assert got[("vllm:time_to_first_token_seconds_count", lab)] == n
    # One inter-token gap per generated token after each request's first.
    assert got[("vllm:inter_token_latency_seconds_count", lab)] == n_tokens_total - n
    assert got[("vllm:request_generation_tokens_sum", lab)] == n_tokens_total
    for r, c in reasons.items():
        if c:
            key = ("vllm:request_success_total", tuple(sorted((*lab, ("finished_reason", r)))))
            assert got[key] == c


def test_observe_many_equals_one_observe_per_sample(rng) -> None:
    """The batched ITL observation gives the buckets and count Histogram.observe gives, value by
    value (values on a bucket's bound included), and the sum up to float rounding."""
    bounds = [0.001, 0.01, 0.05, 0.1, 0.5, 1.0]
    pairs = []
    for _ in range(rng.randint(1, 200)):
        value = rng.choice([rng.choice(bounds), rng.random() * 2, 0.0, rng.random() * 1e-3])
        pairs.append((value, rng.randint(1, 4)))
    regs = []
    for batched in (False, True):
        reg = CollectorRegistry()
        h = Histogram("t_itl", "d", ["m"], buckets=bounds, registry=reg).labels("x")
        if batched:
            observe_many(h, pairs)
        else:
            for value, count in pairs:
                for _ in range(count):
                    h.observe(value)
        regs.append(samples(reg))
    one, many = regs
    assert one.keys() == many.keys()
    for key, v in one.items():
        if key[0].endswith("_sum"):
            assert abs(v - many[key]) <= 1e-9 * max(1.0, abs(v)), key
        elif not key[0].endswith("_created"):
            assert many[key] == v, key


def test_token_buckets_and_names() -> None:
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(4096)[-1] == 2000
    names = metric_names()
    for n in (
        "vllm:num_requests_running",
        "vllm:prompt_tokens_total",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_success_total",
    ):
        assert n in names
    assert status_fields(None) == {}


def test_spec_decode_counters_exposed_per_position(rng) -> None:
    """An EngineStats with speculation counters -> the status hash -> vLLM's spec_decode names,
    the per-position counter under label `position`."""
    from voltserve.services.executor.engine import EngineStats

    per_pos = tuple(rng.randint(0, 1000) for _ in range(rng.randint(1, 6)))
    stats = EngineStats(
        *(rng.randint(0, 100) for _ in range(10)),
        spec_decode_num_drafts=rng.randint(1, 10_000),
        spec_decode_num_draft_tokens=rng.randint(0, 10_000),
        spec_decode_num_accepted_tokens=sum(per_pos),
        spec_decode_num_accepted_tokens_per_pos=per_pos,
    )
    raw = {k.encode(): str(v).encode() for k, v in status_fields(stats).items()}
    reg = CollectorRegistry()
    snap = StatusSnapshot()
    reg.register(ExecutorCollector(snap, model_name="m"))
    snap.set([ExecutorStatus.from_hash(raw, executor_id="e0")])
    got = samples(reg)
    lab = (("engine", "e0"), ("model_name", "m"))
    assert got[("vllm:spec_decode_num_drafts_total", lab)] == stats.spec_decode_num_drafts
    assert got[("vllm:spec_decode_num_draft_tokens_total", lab)] == (
        stats.spec_decode_num_draft_tokens
    )
    assert got[("vllm:spec_decode_num_accepted_tokens_total", lab)] == sum(per_pos)
    for i, v in enumerate(per_pos):
        key = ("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*lab, ("position", str(i))))
        assert got[key] == v
    assert not any(
        k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        and ("position", str(len(per_pos))) in k[1]
        for k in got
    )
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in metric_names()
