"""Speculation's CUDA-graph paths (spec/graphs.py), emulated on the CPU: the verify step's and
the proposers' single-token steps' static buffers, padding and choice of captured size, with
"replay" running the captured forward eagerly on those buffers through the graph-safe torch
fallbacks. The staging must equal a row-by-row rebuild, and the engine's tokens through the
emulated graphs must equal speculation eager and speculation off, for every method."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.graph_set import padded_size
from voltserve.services.executor.kv_sizing import alloc_kv_caches
from voltserve.services.executor.request import ScheduledRequest
from voltserve.services.executor.spec import graph_setup
from voltserve.services.executor.spec.graphs import (
    SPEC_GRAPHS_ENV,
    VerifyGraphRunner,
    stage_step_rows,
    verify_batch_sizes,
    verify_row_counts,
)
from voltserve.services.executor.spec.model_proposer import ModelProposer
from voltserve.services.executor.spec.oracle import OracleProposer
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint
from tests.engine.test_graph_padding import _emulated_graph_runner
from tests.engine.test_spec_eagle import _check_against_reference, spy, write_head
from tests.engine.token_match import assert_streams_match

VOCAB = 384
BS = 16


def _req(computed: int, total: int):
    return SimpleNamespace(num_computed_tokens=computed, num_tokens=total)


def test_verify_row_counts_and_sizes() -> None:
    s = ScheduledRequest
    decoding = [s(_req(9, 10), 3, (5, 6)), s(_req(4, 5), 1)]
    assert verify_row_counts(decoding, 4) == [3, 1]
    assert verify_row_counts(decoding, 3) == [3, 1]
    assert verify_row_counts(decoding, 2) is None  # 2 proposals > q - 1
    # A prefill chunk in the step, or a chunk that does not end at the last known token.
    assert verify_row_counts(decoding + [s(_req(0, 10), 4)], 4) is None
    assert verify_row_counts([s(_req(8, 10), 2, (7,))], 4) is None
    assert verify_row_counts([], 4) is None
    assert padded_size([1, 2, 4, 8], 3) == 4
    assert padded_size([1, 2, 4, 8], 8) == 8
    assert padded_size([1, 2, 4, 8], 9) is None
    assert padded_size([1, 2, 4, 8], 0) is None
    assert verify_batch_sizes([1, 2, 4, 8], 4, lambda rows: rows <= 16) == [1, 2, 4]


def _verify_rebuild(first, specs, starts, blocks, q, padded, width):
    """The verify staging rebuilt row by row: sequence b's rows at b * q + j."""
    N = padded * q
    ids, pos, slots = [0] * N, [0] * N, [-1] * N
    tables = [[0] * width for _ in range(padded)]
    rows = []
    for b, (t, sp, st, blk) in enumerate(zip(first, specs, starts, blocks)):
        last = st + len(sp)
        nblk = last // BS + 1
        tables[b][:nblk] = blk[:nblk]
        for j, tok in enumerate([t, *sp]):
            i = b * q + j
            p = st + j
            ids[i], pos[i], slots[i] = tok, p, blk[p // BS] * BS + p % BS
            rows.append(i)
    return ids, pos, slots, tables, rows


def test_verify_staging_equals_rebuild(rng) -> None:
    q, width, sizes = 4, 6, [1, 2, 4, 8]
    g = VerifyGraphRunner(None, None, "cpu", width, BS, q, sizes, capture=False)
    for _ in range(30):
        B = rng.randint(1, 8)
        starts = [rng.randrange(0, 70) for _ in range(B)]
        specs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, q - 1))] for _ in range(B)]
        first = [rng.randrange(VOCAB) for _ in range(B)]
        # Each request holds its blocks plus up to two spare ones (zeroed in the staged row).
        blocks = [
            rng.sample(range(1, 200), (st + len(sp)) // BS + 1 + rng.randint(0, 2))
            for st, sp in zip(starts, specs)
        ]
        blocks = [b[:width] for b in blocks]
        mirror = np.zeros((B, width + 2), dtype=np.int32)  # a widened mirror: wider than W
        for b, blk in enumerate(blocks):
            mirror[b, : len(blk)] = blk
        # Stale values from an earlier, larger step must not survive in the padded rows.
        g.host_ids[:] = 7
        g.host_pos[:] = 7
        g.host_slots[:] = 7
        g.host_tables[:] = 7
        bs, R = g.stage(first, specs, starts, mirror, [len(b) for b in blocks])
        assert bs == padded_size(sizes, B) and R == sum(len(s) + 1 for s in specs)
        ids, pos, slots, tables, rows = _verify_rebuild(first, specs, starts, blocks, q, bs, width)
        N = bs * q
        assert g.host_ids[:N].tolist() == ids
        assert g.host_pos[:N].tolist() == pos
        assert g.host_slots[:N].tolist() == slots
        assert g.host_tables[:bs].tolist() == tables
        assert g.host_rows[:R].tolist() == rows
    with pytest.raises(ValueError, match="KV blocks"):
        g.stage([1], [[2, 3]], [15], np.zeros((1, width), np.int32), [1])
    with pytest.raises(ValueError, match="proposals"):
        g.stage([1], [[2, 3, 4, 5]], [0], np.zeros((1, width), np.int32), [1])


def test_step_rows_staging(rng) -> None:
    width = 5
    host = {
        "pos": np.full(8, 9, np.int64),
        "slots": np.full(8, 9, np.int64),
        "seq_lens": np.full(8, 9, np.int32),
        "tables": np.full((8, width), 9, np.int32),
    }
    for _ in range(20):
        B = rng.randint(1, 8)
        padded = padded_size([1, 2, 4, 8], B)
        pos = [rng.randrange(0, 60) for _ in range(B)]
        blocks = [rng.sample(range(1, 99), p // BS + 1 + rng.randint(0, 1)) for p in pos]
        live = [rng.random() < 0.7 for _ in range(B)]
        stage_step_rows(host, pos, blocks, live, BS, padded)
        for b in range(padded):
            on = b < B and live[b]
            p = pos[b] if on else 0
            assert host["pos"][b] == p
            assert host["seq_lens"][b] == p + 1
            want = blocks[b][: p // BS + 1] if on else []
            assert host["tables"][b].tolist() == want + [0] * (width - len(want))
            assert host["slots"][b] == (blocks[b][p // BS] * BS + p % BS if on else -1)
    with pytest.raises(ValueError, match="KV blocks"):
        stage_step_rows(host, [16], [[3]], [True], BS, 1)


class _Replay:
    def __init__(self, fn):
        self.replay = fn


def _emulate(g, replayed: list[int]) -> None:
    """What capture leaves: outputs per size; "replay" recomputes them into those tensors."""
    for bs in g.sizes:
        g.outputs[bs] = g._forward(bs)

        def replay(bs=bs):
            replayed.append(bs)
            for out, new in zip(g.outputs[bs], g._forward(bs)):
                out.copy_(new)

        g.graphs[bs] = _Replay(replay)


def _cfg(spec, **kw) -> EngineConfig:
    return engine_config(
        model=str(checkpoint("llama")),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=128,
        max_num_seqs=4,
        speculative_config=spec,
        **kw,
    )


def _graph_engine(spec, max_batch: int = 16, **kw):
    """An engine whose runner replays emulated decode, verify and draft-step graphs of sizes 1,
    2, 4, 8, 16 (max_batch 16; verify: 1, 2, 4, 8 at k = 3); the batch sizes each verify /
    draft replay ran at."""
    cfg = _cfg(spec, **kw)
    runner = _emulated_graph_runner(cfg, max_batch)
    p = runner.proposer
    draft = None
    verify = graph_setup.build_verify_graphs(
        runner, runner.graphs.sizes, runner.kv_caches, capture=False
    )
    if isinstance(p, ModelProposer):
        p.kv = alloc_kv_caches(runner, cfg.num_kv_blocks, scratch=True, arch=p.draft.arch)
        draft = p.make_graphs(runner, runner.graphs.sizes, verify.sizes, p.kv, capture=False)
        p.step_graphs = draft = draft["step"]
    sizes: dict[str, list[int]] = {"verify": [], "draft": []}
    _emulate(verify, sizes["verify"])
    if draft is not None:
        _emulate(draft, sizes["draft"])
    runner.verify_graphs = verify
    return LLMEngine(cfg, runner), sizes


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Repeated phrases: the n-gram proposer finds proposals in them.
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 12))] * 3 for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("eagle") / "head", 7)


def _spec(method: str, head) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    if method == "draft_model":
        # The target as its own draft: every proposal of a correct draft step is accepted.
        model = str(checkpoint("llama"))
        return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("n", [1, 3], ids=["batch1", "batch3-padded"])
def test_emulated_spec_graphs_equal_eager_and_spec_off(method, n, head, seed) -> None:
    """Batch 1 and batch 3 (padded to the size-4 graphs): greedy output through the emulated
    verify (and draft-step) graphs equals speculation eager and speculation off; the graph
    paths ran (at the padded size for batch 3) and no verify step fell back; the draft steps'
    proposals are right (a self-draft's all accepted; EAGLE's equal the torch reference)."""
    prompts = _prompts(seed, n)
    params = _greedy(16)
    want = LLMEngine(_cfg(None)).generate(prompts, params)
    spec = _spec(method, head)
    eager, (eng, sizes) = LLMEngine(_cfg(spec)), _graph_engine(spec)
    if method == "ngram":
        # The n-gram proposer finds nothing in some draws: an oracle (some of its tokens wrong)
        # makes every step verify, in both engines.
        # Request 0's continuation ends early: from then on it verifies nothing while the
        # others verify 3 (rows of a short sequence before full ones).
        cont = {f"generate-1-{i}": w[: 6 if i == 0 else None] for i, w in enumerate(want)}
        for e in (eager, eng):
            e.proposer = OracleProposer(3, cont, 0.3, VOCAB, seed)
    calls = spy(eng) if method == "eagle" else None
    eager = eager.generate(prompts, params)
    got = eng.generate(prompts, params)
    ids = [str(i) for i in range(n)]
    reqs = {i: (p, params) for i, p in zip(ids, prompts)}
    for other in (eager, want):
        assert_streams_match(dict(zip(ids, got)), dict(zip(ids, other)), reqs, checkpoint("llama"))
    counts = eng.runner.spec_graph_counts
    assert eng.stats().spec_decode_num_drafts > 0
    assert counts["verify_graph"] > 0 and counts["verify_eager"] == 0, counts
    assert eng.runner.verify_graphs.num_replays == len(sizes["verify"]) > 0
    padded = padded_size(eng.runner.verify_graphs.sizes, n)
    assert padded in sizes["verify"]
    if method != "ngram":
        # The proposals themselves (acceptance hides wrong ones from the output).
        assert counts["draft_graph"] > 0 and counts["draft_eager"] == 0, counts
        assert padded in sizes["draft"]
    st = eng.stats()
    if method == "draft_model":
        assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens
    if method == "eagle":
        _check_against_reference(head, calls)
    assert eng.check_all_free()


def test_eager_fallback_counted(seed) -> None:
    """A verify step of more requests than the largest captured size runs eagerly, counted,
    with the same output; the smaller batches after it replay graphs."""
    prompts = _prompts(seed, 3)
    lens = (4, 8, 12)
    params = [_greedy(m) for m in lens]
    want = LLMEngine(_cfg(None)).generate(prompts, _greedy(12))
    want = [w[:m] for w, m in zip(want, lens)]
    ids = [f"generate-1-{i}" for i in range(3)]
    # Verify sizes 1, 2: batches of 3, then 2 and 1 as requests finish.
    eng, sizes = _graph_engine({"method": "ngram", "num_speculative_tokens": 2}, max_batch=2)
    eng.proposer = OracleProposer(2, dict(zip(ids, want)), 0.0, VOCAB, seed)
    assert eng.generate(prompts, params) == want
    counts = eng.runner.spec_graph_counts
    assert counts["verify_eager"] > 0 and counts["verify_graph"] > 0, counts
    assert set(sizes["verify"]) == {1, 2}
    assert eng.check_all_free()


def test_spec_graph_sizes(monkeypatch) -> None:
    """The verify sizes: the decode sizes whose rows fit the largest decode graph's; none with
    VOLTSERVE_SPEC_GRAPHS=0 or speculation off (eager steps)."""
    monkeypatch.setenv(SPEC_GRAPHS_ENV, "0")
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    runner = LLMEngine(_cfg(spec)).runner
    sizes = graph_setup.spec_graph_sizes
    assert sizes(runner, 16) == []
    monkeypatch.setenv(SPEC_GRAPHS_ENV, "1")
    # Rows (3 per sequence) up to the largest decode graph's, or up to 8 sequences' rows.
    assert sizes(runner, 16) == [1, 2, 4, 8]
    assert sizes(runner, 2) == [1, 2]
    assert sizes(runner, 256)[-1] == 80  # 80 * 3 <= 256 < 88 * 3
    assert sizes(LLMEngine(_cfg(None)).runner, 16) == []


def _proposals(eng: LLMEngine) -> list[tuple[str, int, list[int]]]:
    """(request id, output length, proposal) of every proposal the engine's proposer makes."""
    calls: list[tuple[str, int, list[int]]] = []
    orig = eng.proposer.propose

    def propose(reqs):
        props = orig(reqs)
        calls.extend((r.request_id, r.num_output_tokens, list(p)) for r, p in zip(reqs, props))
        return props

    eng.proposer.propose = propose
    return calls


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_draft_step_graphs_write_the_eager_kv(method, head, seed) -> None:
    """The proposer's single-token steps through the emulated graphs write the draft's KV cache
    as the eager steps do (same runner set-up, the draft graphs left out), token for token: a
    wrong position, slot, block table or chained input shows there even where the tiny model's
    argmax does not move. Compared when both runs made the same proposals (the runs' matmul
    shapes differ, so a near-tie may part one, and its KV with it)."""
    spec = _spec(method, head)
    if method == "draft_model":
        spec["model"] = str(checkpoint("qwen3"))  # another model: proposals that vary
    prompts = _prompts(seed, 3)
    params = _greedy(12)
    (eng, _), (ref, _) = _graph_engine(spec), _graph_engine(spec)
    ref.proposer.step_graphs = None
    ref.proposer.runner = ref.runner
    a, b = _proposals(eng), _proposals(ref)
    got, want = eng.generate(prompts, params), ref.generate(prompts, params)
    assert eng.runner.spec_graph_counts["draft_graph"] > 0
    assert ref.runner.spec_graph_counts["draft_graph"] == 0
    assert sum(len(p) for _, _, p in a) > 0
    assert got == want
    # A near-tie parts one proposal (the next catch-up rewrites the draft's KV of the known
    # tokens, so the ones after it agree again); a wrong step parts many.
    assert len(a) == len(b)
    parted = sum(x != y for x, y in zip(a, b))
    assert parted <= len(a) // 4, f"{parted} of {len(a)} proposals differ"
    if parted:
        return  # the parted proposals' KV differs
    n = eng.runner.num_kv_blocks  # the scratch block past them differs (padding rows)
    for (k1, v1), (k2, v2) in zip(eng.proposer.kv, ref.proposer.kv):
        torch.testing.assert_close(k1[:n], k2[:n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v1[:n], v2[:n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_start_up_trace_runs_the_spec_graph_forwards(method, head, monkeypatch) -> None:
    """The start-up compile phase's trace (kernel_warmup) builds speculation's graphs on
    one-block caches and runs each size's forward: the verify graphs' and the proposer's step
    graphs' (with k + 1 rows per sequence and the EAGLE head's features)."""
    from voltserve.services.executor import kernel_warmup
    from voltserve.services.executor.model_runner import ModelRunner

    runner = ModelRunner(_cfg(_spec(method, head)))
    seen = []
    verify, own = graph_setup.build_verify_graphs, runner.proposer.make_graphs

    def build(*a, **kw):
        seen.append(verify(*a, **kw))
        return seen[-1]

    def make(*a, **kw):
        seen.append(own(*a, **kw)["step"])
        return {"step": seen[-1]}

    monkeypatch.setattr(graph_setup, "build_verify_graphs", build)
    monkeypatch.setattr(runner.proposer, "make_graphs", make)
    kernel_warmup._trace_spec_graphs(runner, 16)
    (v, d) = seen
    assert v.sizes == [1, 2, 4, 8] and d.sizes == [1, 2, 4, 8, 16] and v.q == 4
    assert v.with_hidden == (method == "eagle") and (d.features is not None) == v.with_hidden


def test_emulated_verify_graph_seeded_sampling_and_logprobs(seed) -> None:
    """Seeded sampling, logprobs requested (the sampler's full path), through the emulated
    verify graphs: every verify row sampled at its own output position from the gathered
    logits, so the tokens equal speculation off's."""
    prompts = _prompts(seed, 3)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=seed, logprobs=1, ignore_eos=True)
    base = LLMEngine(_cfg(None))
    ids = [f"generate-1-{i}" for i in range(3)]
    want = base.generate(prompts, params)
    eng, _ = _graph_engine({"method": "ngram", "num_speculative_tokens": 3})
    cont = {rid: w[: 5 if i == 0 else None] for i, (rid, w) in enumerate(zip(ids, want))}
    eng.proposer = OracleProposer(3, cont, 0.3, VOCAB, seed)
    got = eng.generate(prompts, params)
    keys = [str(i) for i in range(3)]
    reqs = {i: (p, params) for i, p in zip(keys, prompts)}
    assert_streams_match(dict(zip(keys, got)), dict(zip(keys, want)), reqs, checkpoint("llama"))
    assert eng.runner.spec_graph_counts["verify_graph"] > 0
    assert eng.stats().spec_decode_num_accepted_tokens > 0
