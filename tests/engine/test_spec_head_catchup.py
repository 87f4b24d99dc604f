"""The EAGLE and MTP heads' catch-up forward as graphs (spec/eagle.py, spec/graphs.py), emulated
on the CPU as in test_spec_graphs.py: after a verify step each proposing request's pairs (the
kept last one, its accepted proposals and the target's own token: up to k + 2) replay the
head's catch-up graph, whose rows read their features from the graph's buffer, and whose last
row per request feeds the head's step graphs on the device. A wrong row, position, slot,
feature or chained input shows as proposals that differ from the torch reference (EAGLE) or
from the eager catch-up's (MTP, on a hybrid target whose verify steps replay graphs too)."""

from __future__ import annotations

import pytest
from voltserve.services.executor.engine import LLMEngine

from tests.engine.test_hybrid_models import hf_model
from tests.engine.test_hybrid_mtp import PARAMS, prompts
from tests.engine.test_hybrid_verify_graphs import graph_engine
from tests.engine.test_spec_eagle import _check_against_reference, spy, write_head
from tests.engine.test_spec_graphs import _cfg, _emulate, _graph_engine, _greedy, _prompts, _spec
from tests.greedy_reference import check_greedy_outputs
from tests.mtp_checkpoints import mtp_checkpoint


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("eagle") / "head", 11)


def _with_catchup_graphs(eng) -> list[int]:
    """Give the engine's runner emulated head catch-up graphs; the sizes they replayed at."""
    runner = eng.runner
    p = runner.proposer
    c = p.make_graphs(runner, runner.graphs.sizes, runner.verify_graphs.sizes, p.kv, False)
    c = c["catchup"]
    assert c.q == p.k + 2 and c.with_hidden
    replayed: list[int] = []
    _emulate(c, replayed)
    p.catchup_graphs = c
    return replayed


def test_eagle_catch_up_graphs_propose_as_the_reference(head, seed) -> None:
    """EAGLE on the tiny llama, batch 3 (padded to the size-4 graphs): after the first (eager,
    whole-prompt) catch-up every catch-up replays a graph; the output equals speculation off
    and every proposal equals the torch reference of the head over the whole context."""
    spec = _spec("eagle", head)
    prompts_ = _prompts(seed, 3)
    params = _greedy(16)
    want = LLMEngine(_cfg(None)).generate(prompts_, params)
    eng, sizes = _graph_engine(spec)
    replayed = _with_catchup_graphs(eng)
    calls = spy(eng)
    assert eng.generate(prompts_, params) == want
    counts = eng.runner.spec_graph_counts
    assert counts["catchup_graph"] == len(replayed) > 0 and 4 in replayed, counts
    assert counts["catchup_eager"] >= 1, counts  # the first, over the prompts
    assert counts["draft_graph"] > 0 and counts["draft_eager"] == 0, counts
    _check_against_reference(head, calls)
    assert eng.check_all_free()


def test_mtp_catch_up_graphs_on_a_hybrid_target(rng) -> None:
    """MTP on a hybrid target whose verify steps replay graphs, 3 requests: with the catch-up
    graphs the proposals equal the eager catch-up's (the same engine set-up without them) and
    greedy equals transformers."""
    arch = "qwen3_5"
    path = mtp_checkpoint(arch)
    ps = prompts(rng, 3)
    outs, proposals = [], []
    for graphs in (True, False):
        eng, _, _ = graph_engine(path)
        replayed = _with_catchup_graphs(eng) if graphs else []
        calls = spy(eng)
        outs.append(eng.generate(ps, PARAMS))
        proposals.append(calls)
        counts = eng.runner.spec_graph_counts
        if graphs:
            assert counts["catchup_graph"] == len(replayed) > 0, counts
        else:
            assert counts.get("catchup_graph", 0) == 0, counts
        assert eng.check_all_free()
    assert outs[0] == outs[1]
    check_greedy_outputs(hf_model(arch), ps, outs[0], PARAMS.max_tokens)
    assert proposals[0] == proposals[1] and proposals[0]
