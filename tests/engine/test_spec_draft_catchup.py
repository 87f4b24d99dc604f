"""The draft model's catch-up forward as graphs (spec/draft_model.py, spec/graphs.py), emulated on
the CPU as in test_spec_graphs.py: the tokens a verify step made known (up to k + 1 a request)
replay the draft's catch-up graph, whose last row per request feeds the draft's step graphs on
the device. A wrong row, position, slot or chained input shows as rejected proposals of a
self-draft or as a draft KV cache that differs from the eager catch-up's."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.spec.draft_model import known_tokens

from tests.checkpoints import checkpoint
from tests.engine.test_spec_graphs import (
    _cfg,
    _emulate,
    _graph_engine,
    _greedy,
    _prompts,
    _proposals,
)


def _with_catchup_graphs(eng) -> list[int]:
    """Give the engine's runner emulated catch-up graphs; the sizes they replayed at."""
    runner = eng.runner
    p = runner.proposer
    c = p.make_graphs(runner, runner.graphs.sizes, runner.verify_graphs.sizes, p.kv, False)
    c = c["catchup"]
    replayed: list[int] = []
    _emulate(c, replayed)
    p.catchup_graphs = c
    return replayed


def _spec(model: str) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}


def test_known_tokens() -> None:
    r = SimpleNamespace(prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5])
    allt = [1, 2, 3, 4, 5]
    for start in range(5):
        for end in range(start, 6):
            assert known_tokens(r, start, end) == allt[start:end], (start, end)


def test_self_draft_catch_up_graphs_accept_every_proposal(seed) -> None:
    """The target as its own draft, batch 3 (padded to the size-4 graphs): after the first
    (eager, whole-prompt) catch-up every catch-up replays a graph of up to k + 1 = 4 rows, every
    proposal is accepted and the output equals speculation off."""
    prompts = _prompts(seed, 3)
    params = _greedy(16)
    want = LLMEngine(_cfg(None)).generate(prompts, params)
    eng, sizes = _graph_engine(_spec(str(checkpoint("llama"))))
    replayed = _with_catchup_graphs(eng)
    assert eng.generate(prompts, params) == want
    counts = eng.runner.spec_graph_counts
    st = eng.stats()
    assert st.spec_decode_num_draft_tokens > 0
    assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens
    # One eager catch-up (the three prompts at once), graphs after it.
    assert counts["catchup_eager"] == 1, counts
    assert counts["catchup_graph"] == len(replayed) > 0 and set(replayed) == {4}, counts
    assert counts["draft_graph"] > 0 and counts["draft_eager"] == 0, counts
    assert 4 in sizes["draft"]
    assert eng.check_all_free()


def test_catch_up_graphs_write_the_eager_kv(seed) -> None:
    """Another model as the draft (proposals partly rejected, so catch-ups of 1..4 tokens): the
    catch-up graphs write the draft's KV cache as the eager catch-up does, and make the same
    proposals (up to a near-tie, as in test_draft_step_graphs_write_the_eager_kv)."""
    spec = _spec(str(checkpoint("qwen3")))
    prompts = _prompts(seed, 3)
    params = _greedy(12)
    (eng, _), (ref, _) = _graph_engine(spec), _graph_engine(spec)
    _with_catchup_graphs(eng)
    a, b = _proposals(eng), _proposals(ref)
    got, want = eng.generate(prompts, params), ref.generate(prompts, params)
    assert eng.runner.spec_graph_counts["catchup_graph"] > 0
    assert ref.runner.spec_graph_counts.get("catchup_graph", 0) == 0
    assert got == want
    assert len(a) == len(b) and sum(len(p) for _, _, p in a) > 0
    parted = sum(x != y for x, y in zip(a, b))
    assert parted <= len(a) // 4, f"{parted} of {len(a)} proposals differ"
    if parted:
        return
    n = eng.runner.num_kv_blocks  # the scratch block past them differs (padding rows)
    for (k1, v1), (k2, v2) in zip(eng.proposer.kv, ref.proposer.kv):
        torch.testing.assert_close(k1[:n], k2[:n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v1[:n], v2[:n], atol=1e-4, rtol=1e-4)
