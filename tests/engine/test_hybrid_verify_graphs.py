"""Verify graphs on a target with linear-attention state (spec/graphs.py with a state cache,
state_rollback.VerifyLayout), emulated on the CPU as tests/engine/test_spec_graphs.py does: the
graphs' fixed layout walks the Gated DeltaNet layers one position at a time, rows past a
sequence's proposals and padding sequences at state slot -1, each sequence's state after each
position in the snapshot area, and the kept one committed at the next step. Greedy through the
graphs equals transformers' (teacher-forced, fp32), with proposals rejected and accepted by
construction, 3 requests padded to the size-4 graph; the staged layout itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.kv_sizing import alloc_kv_caches
from voltserve.services.executor.spec import graph_setup
from voltserve.services.executor.spec.graphs import VerifyGraphRunner
from voltserve.services.executor.state_cache import LayerStateSpec, StateCache

from tests.checkpoints import hf_model_class
from tests.engine.test_graph_padding import _emulated_graph_runner
from tests.engine.test_hybrid_models import hf_model
from tests.engine.test_hybrid_mtp import MTP, PARAMS, config, prompts
from tests.engine.test_spec_graphs import _emulate
from tests.greedy_reference import check_greedy_outputs
from tests.mtp_checkpoints import A, B, C, chain_checkpoint, mtp_checkpoint

MAX_BATCH = 4


def graph_engine(path) -> tuple[LLMEngine, list[int], list[int]]:
    """An engine whose runner replays emulated decode, verify and MTP step graphs (sizes 1, 2,
    4); the sizes the verify and step graphs replayed at. A 64-token budget prefills every
    prompt in one step, so every later step is a verify graph's."""
    cfg = config(path, MTP, num_kv_blocks=64, max_num_seqs=MAX_BATCH, max_num_batched_tokens=64)
    runner = _emulated_graph_runner(cfg, MAX_BATCH)
    verify = graph_setup.build_verify_graphs(
        runner, runner.graphs.sizes, runner.kv_caches, capture=False
    )
    assert verify.sizes == [1, 2, 4] and verify.state_cache is runner.state_cache
    p = runner.proposer
    p.kv = alloc_kv_caches(runner, cfg.num_kv_blocks, scratch=True, arch=p.draft.arch)
    step = p.make_graphs(runner, runner.graphs.sizes, verify.sizes, p.kv, capture=False)["step"]
    replayed_verify: list[int] = []
    replayed_step: list[int] = []
    _emulate(verify, replayed_verify)
    _emulate(step, replayed_step)
    runner.verify_graphs = verify
    p.step_graphs = step
    return LLMEngine(cfg, runner), replayed_verify, replayed_step


def test_mtp_verify_graphs_on_a_hybrid_target(rng) -> None:
    """The MTP head (random: most proposals rejected, some accepted) through verify graphs, 3
    requests: greedy equals transformers, every verify step ran as a graph, at the padded size
    4 while all three decode (a padding sequence beside them)."""
    arch = "qwen3_5"
    eng, verify, step = graph_engine(mtp_checkpoint(arch))
    ps = prompts(rng, 3)
    check_greedy_outputs(hf_model(arch), ps, eng.generate(ps, PARAMS), PARAMS.max_tokens)
    counts = eng.runner.spec_graph_counts
    assert counts["verify_graph"] > 0 and counts["verify_eager"] == 0, counts
    # fewer sizes once a request has finished before the others
    assert 4 in verify and step
    assert eng.stats().spec_decode_num_drafts > 0
    assert eng.check_all_free()


def test_verify_graphs_roll_back_by_construction(rng) -> None:
    """tests/engine/test_hybrid_mtp.py's chain target through the graphs: after a prompt ending
    in C the first verify rejects at the first position (the state committed from snapshot 0),
    every later one accepts all k (nothing to commit); two random prompts in the same graphs
    (padded to 4) stay exact."""
    path = chain_checkpoint()
    model = hf_model_class(path).from_pretrained(path, dtype=torch.float32).eval()
    eng, verify, _ = graph_engine(path)
    ps = [prompts(rng, 1)[0] + [C], *prompts(rng, 2)]
    outs = eng.generate(ps, PARAMS)
    assert outs[0] == [B] + [A] * (PARAMS.max_tokens - 1)
    check_greedy_outputs(model, ps, outs, PARAMS.max_tokens)
    st = eng.stats()
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    counts = eng.runner.spec_graph_counts
    assert counts["verify_graph"] > 0 and counts["verify_eager"] == 0, counts
    assert eng.check_all_free()


def test_verify_layout_staging() -> None:
    """The staged state slots: row (b, j) carries b's slot for j <= m_b and -1 past it and for
    padding sequences (the verify ops read a sequence's slot from its first row)."""
    q, width, bs = 4, 4, 16
    spec = LayerStateSpec((6, 3), (2, 4, 4))
    cache = StateCache([spec, spec], 8, torch.float32, torch.device("cpu"), (q - 1, 4))
    g = VerifyGraphRunner(
        None, None, "cpu", width, bs, q, [1, 2, 4], capture=False, state_cache=cache
    )
    tables = np.arange(3 * width, dtype=np.int32).reshape(3, width)
    padded, rows = g.stage(
        [5, 6, 7], [[1, 2], [], [3, 4, 5]], [10, 20, 30], tables, [4, 4, 4], state_slots=[7, 2, 5]
    )
    assert (padded, rows) == (4, 3 + 5)
    state = g.st.host["state"][: padded * q].reshape(padded, q)
    assert state.tolist() == [[7, 7, 7, -1], [2, -1, -1, -1], [5, 5, 5, 5], [-1] * 4]
    # Sequence b's state after its row j goes to the cache's snapshot row (j, b).
    want = [[cache.snapshot_row(j, b) for j in range(q - 1)] for b in range(4)]
    assert g.snap_rows.tolist() == want
    with pytest.raises(ValueError, match="area holds 4 of 3"):
        cache.snapshot_rows(5, 3)
    with pytest.raises(ValueError, match="area holds 4 of 3"):
        cache.snapshot_rows(4, 4)
    with pytest.raises(ValueError, match="need the slots"):
        g.stage([5], [[1]], [10], tables, [4])
    with pytest.raises(ValueError, match="snapshots 4"):
        VerifyGraphRunner(None, None, "cpu", width, bs, q, [8], capture=False, state_cache=cache)


def test_state_cache_restore_copies_every_layer() -> None:
    """StateCache.restore: snapshot rows into request slots in every layer (layers of one spec
    share a stacked tensor; a layer of another spec its own), nothing else touched."""
    gen = torch.Generator().manual_seed(0)
    a, b = LayerStateSpec((6, 3), (2, 4, 4)), LayerStateSpec((5, 3), (1, 4, 4))
    cache = StateCache([a, b, a], 3, torch.float32, torch.device("cpu"), (2, 2))
    for conv, rec in cache.rows:
        conv.copy_(torch.randn(conv.shape, generator=gen))
        rec.copy_(torch.randn(rec.shape, generator=gen))
    before = [(c.clone(), r.clone()) for c, r in cache.rows]
    src = [cache.snapshot_row(1, 0), cache.snapshot_row(0, 1)]
    assert src == [3 + 2, 3 + 1]
    cache.restore([2, 0], src)
    for (c, r), (c0, r0) in zip(cache.rows, before):
        for t, t0 in ((c, c0), (r, r0)):
            assert torch.equal(t[2], t0[src[0]]) and torch.equal(t[0], t0[src[1]])
            assert torch.equal(t[1], t0[1]) and torch.equal(t[3:], t0[3:])
