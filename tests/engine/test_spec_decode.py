"""Speculative decoding on the real model runner (fp32, CPU, tiny checkpoints): output equals
speculation off and transformers token for token, under batching, chunked prefill, preemption,
stops inside an accepted run, logprobs and seeded sampling; acceptance preserves the target's
distribution (chi-square); every KV block comes back."""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch
from voltserve.services.executor.block_manager import BlockManager
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.request import Request
from voltserve.services.executor.spec.config import SpeculativeConfig
from voltserve.services.executor.spec.ngram import ngram_lookup
from voltserve.services.executor.spec.oracle import OracleProposer
from voltserve.services.executor.spec.proposer import Proposer
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint
from tests.engine.test_engine_e2e import assert_greedy, hf_model

VOCAB = 384
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def engine(spec=None, **kw) -> LLMEngine:
    cfg = engine_config(
        model=str(checkpoint("llama")),
        device="cpu",
        dtype="float32",
        speculative_config=spec,
        **kw,
    )
    return LLMEngine(cfg)


@pytest.fixture(scope="module")
def seed() -> int:
    s = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"VOLTSERVE_TEST_SEED={s}")
    return s


def repetitive_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: n-gram lookup finds proposals in them."""
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 24))] * 3 for _ in range(n)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run(eng: LLMEngine, prompts, params, proposer=None):
    """generate() with the request ids known up front (the oracle proposes by id)."""
    if proposer is not None:
        eng.proposer = proposer
    outs = eng.generate(prompts, params)
    assert eng.check_all_free()
    eng.block_manager.check_invariants()
    return outs


def check_reference(prompts, outs, n: int) -> None:
    """Each output n greedy tokens under transformers, teacher-forced (a tie may go either way:
    tests/greedy_reference.py)."""
    assert len(outs) == len(prompts)
    for p, o in zip(prompts, outs):
        assert_greedy("llama", p, o, n, True)


# ---- config ------------------------------------------------------------------------------


def test_config_keys_and_errors():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 1, 4)
    c = SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 3)
    bad = [
        ("{", "not valid JSON"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "not supported yet"),
        ('{"method": "x", "num_speculative_tokens": 2}', "unknown method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "unsupported keys"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min 3 > prompt_lookup_max 2",
        ),
    ]
    for text, msg in bad:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.from_json(text)


def test_ngram_lookup():
    import numpy as np

    t = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert ngram_lookup(t, 3, 1, 3) == [8, 9, 1]  # suffix 5 6 7 seen at 0
    assert ngram_lookup(t, 10, 1, 3) == [8, 9, 1, 5, 6, 7]  # up to the end of the history
    assert ngram_lookup(np.array([1, 2, 3, 4]), 3, 1, 3) == []
    # The longest suffix wins over a later shorter match: ... 2 7 | 9 7 -> "9 7" not "7"
    t = np.array([9, 7, 4, 4, 2, 7, 3, 9, 7])
    assert ngram_lookup(t, 1, 1, 2) == [4]
    # prompt_lookup_min bounds the shortest suffix tried.
    assert ngram_lookup(np.array([3, 1, 2, 3]), 2, 2, 2) == []
    assert ngram_lookup(np.array([3, 1, 2, 3]), 2, 1, 2) == [1, 2]


def test_block_manager_take_back():
    bm = BlockManager(8, 4)
    r = Request("a", list(range(6)), SamplingParams(), 0, 0.0)
    assert bm.allocate(r, [], 6)
    r.num_computed_tokens = 6
    bm.cache_full_blocks(r)  # block 0 registered
    r.output_token_ids = [9]
    assert bm.append_slots(r, 1 + 6)  # 13 slots: 4 blocks
    old = r.block_ids
    assert len(old) == 4
    r.num_computed_tokens = 8  # two of six proposals accepted
    bm.take_back(r, 9)
    assert r.block_ids == old[:3] and r.block_ids is not old  # replaced, not shortened
    assert bm.num_free_blocks == 5
    bm.check_invariants()
    with pytest.raises(RuntimeError, match="computed tokens"):
        bm.take_back(r, 4)


# ---- greedy: token for token -------------------------------------------------------------


def test_greedy_ngram_equals_spec_off_and_transformers(seed):
    rng = random.Random(seed)
    prompts = repetitive_prompts(rng, 4)
    eng = engine(NGRAM)
    check_reference(prompts, run(eng, prompts, greedy(24)), 24)
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0
    assert st.spec_decode_num_accepted_tokens == sum(st.spec_decode_num_accepted_tokens_per_pos)
    assert st.generation_tokens_total == 4 * 24


@functools.cache
def _recorded(seed: int, lengths: tuple[int, int] = (3, 40)):
    """Prompts, their greedy outputs (speculation off, engine; checked against transformers) and
    the oracle's continuations."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(*lengths))] for _ in range(5)]
    base = engine()
    outs = base.generate(prompts, greedy(30))
    check_reference(prompts, outs, 30)
    return prompts, outs


@pytest.mark.parametrize(
    "kw, corrupt",
    [
        ({}, 0.0),  # batched, a perfect drafter
        ({}, 0.3),
        ({"max_num_batched_tokens": 7}, 0.3),  # chunked prefill, speculation within the budget
        ({"num_kv_blocks": 9}, 0.3),  # preemption
    ],
    ids=["batch", "batch-corrupt", "chunked", "preempt"],
)
def test_greedy_oracle_equals_spec_off(seed, kw, corrupt):
    # preempt: 11-16-token prompts need 2 blocks each (10 > 9) by decode step 6, before any ends
    prompts, outs = _recorded(seed, (11, 17) if "num_kv_blocks" in kw else (3, 40))
    eng = engine({"method": "ngram", "num_speculative_tokens": 4}, **kw)
    ids = [f"generate-1-{i}" for i in range(len(prompts))]
    oracle = OracleProposer(4, dict(zip(ids, outs)), corrupt, VOCAB, seed)
    assert run(eng, prompts, greedy(30), oracle) == outs
    st = eng.stats()
    if corrupt == 0.0 and not kw:
        # A perfect drafter: every proposed token accepted.
        assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens > 0
        assert st.spec_decode_mean_acceptance_length > 3
    if "num_kv_blocks" in kw:
        assert st.num_preemptions_total > 0
    assert st.generation_tokens_total == 5 * 30


def test_stops_inside_accepted_run(seed):
    """A stop token, max_tokens and min_tokens falling inside one accepted run end exactly
    where speculation off ends; logprobs come per emitted token, equal to spec off's."""
    prompts, outs = _recorded(seed)
    params = []
    for o in outs:
        stop = o[7]
        params.append(
            SamplingParams(
                max_tokens=23, temperature=0.0, stop_token_ids=[stop], min_tokens=3, logprobs=2
            )
        )
    base = engine()
    ids = [f"generate-1-{i}" for i in range(len(prompts))]
    want = _collect(base, prompts, params, ids)
    eng = engine({"method": "ngram", "num_speculative_tokens": 5})
    eng.proposer = OracleProposer(5, dict(zip(ids, outs)), 0.0, VOCAB)
    got = _collect(eng, prompts, params, ids)
    assert eng.stats().spec_decode_num_accepted_tokens > 0
    assert got.keys() == want.keys()
    for rid in want:
        (toks, lps, reason), (wt, wl, wr) = got[rid], want[rid]
        assert toks == wt and reason == wr
        assert len(lps) == len(toks)
        for a, b in zip(lps, wl):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    assert eng.check_all_free()


def test_proposals_capped_at_num_speculative_tokens(seed):
    """A proposer that returns more than num_speculative_tokens (an n-gram lookup or a custom
    proposer can) gets at most k of them verified per request and step, what the verify
    graphs and token budget are sized for; the output stays speculation off's."""
    prompts, outs = _recorded(seed)
    k = 2
    eng = engine({"method": "ngram", "num_speculative_tokens": k})
    ids = [f"r{i}" for i in range(len(prompts))]
    eng.proposer = OracleProposer(k + 3, dict(zip(ids, outs)), 0.0, VOCAB)
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, greedy(30))
    got = {rid: [] for rid in ids}
    prev = st = eng.stats()
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
        st = eng.stats()
        drafts = st.spec_decode_num_drafts - prev.spec_decode_num_drafts
        tokens = st.spec_decode_num_draft_tokens - prev.spec_decode_num_draft_tokens
        assert tokens <= k * drafts, (tokens, drafts)
        prev = st
    assert [got[rid] for rid in ids] == outs
    # a perfect drafter: every verified token accepted, at positions 0..k-1 only
    assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens > 0
    assert len(st.spec_decode_num_accepted_tokens_per_pos) == k
    assert eng.check_all_free()


def _collect(eng, prompts, params, ids):
    res = {rid: ([], [], None) for rid in ids}
    for rid, p, sp in zip(ids, prompts, params):
        eng.add_request(rid, p, sp)
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks, lps, _ = res[o.request_id]
            toks.extend(o.new_token_ids)
            lps.extend(o.new_logprobs or [])
            res[o.request_id] = (toks, lps, o.finish_reason)
    return res


# ---- sampling ----------------------------------------------------------------------------


def test_seeded_sampling_equals_spec_off(seed):
    """Acceptance reuses the target's (seed, position) draw: the very tokens of spec off, with
    penalties, top-p and min-p counted over the proposed prefix."""
    prompts, outs = _recorded(seed)
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=0.8,
            top_p=0.9,
            min_p=0.01,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
            seed=seed + i,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    want = engine().generate(prompts, params)
    eng = engine({"method": "ngram", "num_speculative_tokens": 3})
    ids = [f"generate-1-{i}" for i in range(len(prompts))]
    # Proposals from the sampled run itself: most are accepted, so multi-token runs happen.
    assert run(eng, prompts, params, OracleProposer(3, dict(zip(ids, want)), 0.2, VOCAB)) == want
    assert eng.stats().spec_decode_num_accepted_tokens > 0


class _FixedProposer(Proposer):
    def __init__(self, token: int) -> None:
        super().__init__(1)
        self.token = token

    def propose(self, requests):
        return [[self.token] for _ in requests]


def test_rejection_sampling_keeps_target_distribution():
    """Draws of (out1, out2) for one prompt over many seeds, out1 always checked against a
    fixed proposal, against the target's exact joint distribution (transformers' logits, top-k
    4 at temperature 1: 16 cells). Chi-square with 15 degrees of freedom; the threshold 56.49
    is scipy.stats.chi2.isf(1e-6, 15): a correct sampler fails with probability 1e-6 per fresh
    seed set, and the seeds here are fixed, so the test is deterministic."""
    prompt = [11, 57, 3, 200, 91, 42]
    model = hf_model("llama")
    K = 4

    def dist(ctx):
        with torch.no_grad():
            logits = model(torch.tensor([ctx])).logits[0, -1].float()
        v, i = logits.topk(K)
        return dict(zip(i.tolist(), torch.softmax(v, -1).tolist()))

    p0 = dist(prompt)
    t0 = max(p0, key=p0.get)
    p1_of = {a: dist(prompt + [a]) for a in p0}
    proposal = max(p1_of[t0], key=p1_of[t0].get)  # often accepted, often not
    expected = {(a, b): pa * pb for a, pa in p0.items() for b, pb in p1_of[a].items()}
    # A random tiny model's top 4 are nearly flat; the chi-square approximation wants >= 5.
    assert min(expected.values()) * 400 >= 5

    N = 400
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=K, seed=1000 + s, ignore_eos=True)
        for s in range(N)
    ]
    eng = engine({"method": "ngram", "num_speculative_tokens": 1}, max_num_seqs=300)
    eng.proposer = _FixedProposer(proposal)
    got = eng.generate([prompt] * N, params)
    st = eng.stats()
    assert st.spec_decode_num_drafts == N
    assert 0 < st.spec_decode_num_accepted_tokens < N
    counts: dict[tuple[int, int], int] = {}
    for o in got:
        counts[(o[0], o[1])] = counts.get((o[0], o[1]), 0) + 1
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(c, 0) - N * p) ** 2 / (N * p) for c, p in expected.items())
    print(f"chi2 {chi2:.2f} (df 15), accepted {st.spec_decode_num_accepted_tokens}/{N}")
    assert chi2 < 56.49
    # And the same draws as speculation off (a share of them, to keep the test short).
    assert engine(max_num_seqs=300).generate([prompt] * 100, params[:100]) == got[:100]


def test_cli_flag_validated(capsys):
    """`voltserve executor` / `serve` take --speculative-config and refuse a bad one by name."""
    from voltserve.services import launcher
    from voltserve.services.executor import main as executor_main

    args = executor_main.build_parser().parse_args(
        ["--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    cfg = executor_main.engine_config(args)
    assert cfg.speculative_config.num_speculative_tokens == 2
    assert cfg.speculative_config.prompt_lookup_max == 4
    for parser in (executor_main.build_parser(), launcher.build_parser()):
        with pytest.raises(SystemExit):
            parser.parse_args(
                ["--model", "m", "--speculative-config", '{"method": "eagle3", "model": "x"}']
            )
        assert "method 'eagle3' is not supported yet" in capsys.readouterr().err


# ---- draft model -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "draft, kw",
    [
        # The target itself: every proposal accepted (chunked prefill: a 9-token budget).
        ("llama", {"max_num_batched_tokens": 9}),
        ("qwen3", {"num_kv_blocks": 9}),  # another model, same tokenizer; preemption
    ],
    ids=["self-chunked", "other-preempt"],
)
def test_draft_model_greedy_equals_spec_off(seed, draft, kw):
    # preempt: 11-16-token prompts need 2 blocks each (10 > 9) by decode step 6, before any ends
    prompts, outs = _recorded(seed, (11, 17) if "num_kv_blocks" in kw else (3, 40))
    spec = {"method": "draft_model", "model": str(checkpoint(draft)), "num_speculative_tokens": 3}
    eng = engine(spec, **kw)
    assert eng.proposer.draft is not None and eng.proposer.kv
    assert run(eng, prompts, greedy(30)) == outs
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0
    if draft == "llama":
        assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens
    else:
        assert st.num_preemptions_total > 0


def test_draft_model_refused_with_another_tokenizer(tmp_path):
    from voltserve.services.executor.demo_model import build_tokenizer, write_checkpoint
    from voltserve.shared.startup import StartupError

    from tests.checkpoints import TINY

    other = write_checkpoint(
        tmp_path / "other",
        arch="llama",
        size="tiny",
        seed=9,
        # Rounded up to the target's 384 model vocabulary, but another vocabulary.
        tokenizer=build_tokenizer(vocab_size=340),
        **{**TINY, "num_hidden_layers": 1},
    )
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(StartupError, match="its tokenizer differs from the target's"):
        engine(spec)
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})
