"""bench_spec's parts (load_tests/bench_spec.py) on the CPU with the tiny test checkpoint: every
engine a part builds is released when the part ends, whether it finished or raised (the engines
of earlier parts once stayed alive on the GPU until a later engine found no room for its KV
cache); a part's failure is recorded and leaves the others running; the oracle keeps proposing k
tokens a step when its recording is stale, and re-records from the run's own output until the
two agree; the n-gram workload's prompt makes the lookup propose the recorded continuation."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from voltserve.services.executor.spec.ngram import ngram_lookup
from voltserve.services.executor.spec.oracle import OracleProposer

from load_tests import bench_spec
from tests.checkpoints import checkpoint


def _args(*extra: str):
    return bench_spec.parse_args(
        ["--preset", "tiny", "--device", "cpu", "--batch-sizes", "1", "--output-len", "12", *extra]
    )


def _engine(spec=None, args=None):
    args = args or _args()
    return bench_spec.make_engine(checkpoint("llama"), "cpu", "float32", args, spec, 32)


def _result() -> dict:
    return {"errors": {}, "released": {}}


class _Boom(Exception):
    pass


def test_parts_release_their_engines_and_record_failures() -> None:
    """After part() returns, no engine (nor its runner or model) of the part is reachable, also
    when the part raised from inside engine.step (the traceback held the engine's frames), and
    with a draft model (its proposer and the runner reference each other); the failure is in
    `errors` and the next part runs. An engine kept alive on purpose is reported."""
    refs: list[weakref.ref] = []
    prompt = list(range(3, 20))

    def track(eng) -> None:
        refs.extend(weakref.ref(x) for x in (eng, eng.runner, eng.runner.model))

    def ok() -> None:
        eng = _engine()
        track(eng)
        bench_spec.run(eng, "cpu", [prompt], 4, "ok")

    def raises() -> None:
        eng = _engine({"method": "ngram", "num_speculative_tokens": 2})
        track(eng)

        class Bad(OracleProposer):
            def propose(self, requests):
                raise _Boom("proposer failed")

        bench_spec.with_proposer(eng, Bad(2, {}), "cpu", [prompt], 4, "bad")

    def draft() -> None:
        spec = {
            "method": "draft_model",
            "model": str(checkpoint("llama")),
            "num_speculative_tokens": 2,
        }
        eng = _engine(spec)
        track(eng)
        refs.append(weakref.ref(eng.proposer))
        bench_spec.with_proposer(eng, eng.proposer, "cpu", [prompt], 4, "draft")

    result = _result()
    assert bench_spec.part(result, "ok", None, ok)
    assert not bench_spec.part(result, "raises", None, raises)
    assert bench_spec.part(result, "draft", None, draft)
    assert result["errors"] == {"raises": "_Boom: proposer failed"}
    assert all(r["engines_alive"] == 0 for r in result["released"].values()), result
    gc.collect()
    assert len(refs) == 10 and all(r() is None for r in refs)

    kept = []
    assert not bench_spec.part(result, "leaks", None, lambda: kept.append(_engine()))
    assert result["released"]["leaks"]["engines_alive"] == 1
    assert "leaks_release" in result["errors"]
    kept.clear()
    assert bench_spec.release()["engines_alive"] == 0


def test_oracle_keeps_proposing_k_and_re_records() -> None:
    """A stale recording (the target's greedy output with every token from position 3 on
    replaced) is still proposed k at a time: every step verifies min(k, room) tokens. The
    re-recording passes then propose the run's own output: the second pass's output equals
    its recording and every proposal is accepted (fp32 on the CPU: the verify rows compute
    the decode step's tokens)."""
    args = _args("--oracle-passes", "3")
    k, L = 3, args.output_len
    eng = _engine({"method": "ngram", "num_speculative_tokens": k}, args)
    prompt = list(range(5, 25))
    (want,) = bench_spec.run(eng, "cpu", [prompt], L, "off")["tokens"]
    stale = want[:3] + [(t + 1) % 384 for t in want[3:]]
    one = bench_spec.oracle_run(
        eng, k, [stale], 0.0, _args("--oracle-passes", "1"), "cpu", 384, [prompt], "one"
    )
    assert one["oracle_passes"] == 1 and one["first_parting"] == [3]
    assert not one["output_equals_recording"]
    # Output lengths n = 1..L-1 before each step (every proposal from position 3 on rejected
    # once the run parts; before that, accepted k at a time).
    assert one["proposed_per_draft"] is not None and one["num_drafts"] > 0
    n, want_drafts, want_tokens = 1, 0, 0
    while n < L:
        m = min(k, L - n - 1)
        if m == 0:
            break
        want_drafts += 1
        want_tokens += m
        acc = max(0, min(m, 3 - n))  # proposals before position 3 equal the target's
        n += acc + 1
    assert (one["num_drafts"], one["num_draft_tokens"]) == (want_drafts, want_tokens)
    r = bench_spec.oracle_run(eng, k, [stale], 0.0, args, "cpu", 384, [prompt], "re")
    assert r["oracle_passes"] == 2 and r["output_equals_recording"], r
    assert r["acceptance_rate"] == 1.0
    e = bench_spec.expected_acceptance(3, 0.5)
    assert e["intended_token_acceptance"] == 0.5
    assert e["expected_mean_acceptance_length"] == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_ngram_workload_proposes_the_continuation() -> None:
    """P + C + P: the lookup over prompt and output proposes C from where the output stands, for
    as long as the output has followed C (vLLM's prompt_lookup_min / _max: the suffix lengths
    tried); once the output leaves C there is nothing to propose."""
    rng = np.random.default_rng(0)
    P, C = rng.integers(3, 10_000, 20).tolist(), rng.integers(3, 10_000, 8).tolist()
    prompt = P + C + P
    for j in range(len(C)):
        toks = np.asarray(prompt + C[:j])
        assert ngram_lookup(toks, 3, 1, 4) == (C + P)[j : j + 3]  # P follows C in the prompt
    assert ngram_lookup(np.asarray(prompt + [10_001]), 3, 1, 4) == []
    assert bench_spec.matches([1, 2, 9, 4], [1, 2, 3, 4]) == {"equal": 3, "common_prefix": 2}
