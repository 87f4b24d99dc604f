"""The Grafana dashboard queries only metrics voltserve exposes, and is what its generator
writes."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from voltserve.shared.metrics import metric_names

ROOT = Path(__file__).resolve().parents[2]
DASH = ROOT / "compose/grafana/dashboards/voltserve.json"
NAME = re.compile(r"\b((?:vllm|voltserve):[A-Za-z0-9_:]+)")


def exprs(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dash.get("templating", {}).get("list", [])]
    return out


def test_dashboard_uses_only_exposed_metric_names() -> None:
    dash = json.loads(DASH.read_text())
    used = {m for e in exprs(dash) for m in NAME.findall(e)}
    assert used, "no metric names found in the dashboard"
    unknown = used - metric_names()
    assert not unknown, f"dashboard queries metrics nobody exposes: {sorted(unknown)}"
    # The panels the operators asked for are there.
    for needed in (
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert needed in used, needed


def test_name_check_can_fail() -> None:
    assert "vllm:no_such_metric_total" not in metric_names()
    assert NAME.findall('rate(vllm:foo_total{engine="x"}[1m])') == ["vllm:foo_total"]


def test_dashboard_json_is_generated() -> None:
    spec = importlib.util.spec_from_file_location("mk", ROOT / "compose/grafana/make_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert DASH.read_text() == mod.render(), "run compose/grafana/make_dashboard.py"
