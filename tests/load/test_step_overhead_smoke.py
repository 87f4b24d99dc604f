"""CI smoke of load_tests/bench_step_overhead.py: a tiny run writes its JSON with every phase of
every case. Timings are not checked (they say nothing on a CI box); the shape of the run is."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from load_tests import bench_step_overhead as bench  # noqa: E402


def _check_phases(case: dict) -> None:
    for p in (*bench.PHASES, "host", "engine_host"):
        assert set(case[p]) == {"median_ms", "mean_ms"}, p
        assert case[p]["median_ms"] >= 0 and case[p]["mean_ms"] >= 0, p
    assert case["host"]["mean_ms"] > 0


def test_step_overhead_smoke(tmp_path):
    out = tmp_path / "step_overhead.json"
    bench.main(
        [
            "--batch-sizes",
            "1,5",
            "--context",
            "40",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--max-num-batched-tokens",
            "64",
            "--mixed-decodes",
            "3",
            "--mixed-prefill-tokens",
            "20",
            "--mixed-reps",
            "2",
            "--gateways",
            "2",
            "--out",
            str(out),
        ]
    )
    d = json.loads(out.read_text())
    assert "git_commit" in d["env"]
    assert [c["batch_size"] for c in d["decode"]] == [1, 5]
    for c in d["decode"]:
        assert c["steps_not_full_batch"] == 0
        # Every timed decode step ran on the (emulated) graph path.
        assert c["graph_steps"] == c["steps"] == 4
        assert len(c["host_ms_all"]) == 4
        assert c["argmax_ms"] > 0
        _check_phases(c)
    # 5 x 40 prompt tokens at 64 a step: the prefill spans several steps.
    assert d["decode"][1]["prefill_steps"] >= 4
    m = d["mixed"]
    assert m["decodes"] == 3 and m["prefill_tokens"] == 20 and m["reps"] == 2
    _check_phases(m)
