"""Speculative decoding with structured outputs and prompt logprobs (fp32, CPU, tiny qwen2).

A constrained request's proposals stop at the first token its grammar rejects, its verify rows
are masked with the grammar's state after each proposed prefix, and its matcher advances over
the emitted tokens only: the output satisfies the constraint and equals speculation off, token
for token, greedy or seeded, alone or batched with unconstrained requests. Prompt logprobs are
unchanged by speculation.
"""

from __future__ import annotations

import json
import re

import pytest
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.spec.oracle import OracleProposer
from voltserve.services.executor.spec.proposer import Proposer
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint

pytest.importorskip("xgrammar")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
REGEX = r"[a-z]{2,4}-[0-9]{1,2}( [A-Z])?"
CHOICES = ["yes", "no", "maybe so", 'it\'s "x"']


def make_engine(spec=None) -> LLMEngine:
    cfg = engine_config(
        model=str(checkpoint("qwen2")),
        device="cpu",
        dtype="float32",
        num_kv_blocks=256,
        speculative_config=spec,
    )
    return LLMEngine(cfg)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint("qwen2"))


@pytest.fixture(scope="module")
def base():
    return make_engine()


def collect(eng: LLMEngine, prompts, params, ids) -> dict[str, tuple]:
    """Run to completion: request id -> (tokens, finish_reason, error, prompt_logprobs)."""
    res = {rid: [[], None, None, None] for rid in ids}
    for rid, p, sp in zip(ids, prompts, params):
        eng.add_request(rid, p, sp)
    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            r = res[o.request_id]
            r[0].extend(o.new_token_ids)
            if o.prompt_logprobs is not None:
                r[3] = o.prompt_logprobs
            if o.finished:
                r[1], r[2] = o.finish_reason, o.error
    assert not eng.has_unfinished_requests(), "requests did not finish"
    assert eng.check_all_free()
    eng.block_manager.check_invariants()
    return {rid: tuple(v) for rid, v in res.items()}


def constrained(rng, n: int, greedy: bool) -> list[SamplingParams]:
    """Alternating regex / choice constraints; seeded temperature-1 sampling unless greedy."""
    out = []
    for i in range(n):
        s = (
            {"type": "regex", "value": REGEX}
            if i % 2 == 0
            else {"type": "choice", "value": CHOICES}
        )
        kw = (
            {"temperature": 0.0} if greedy else {"temperature": 1.0, "seed": rng.randrange(1 << 30)}
        )
        out.append(SamplingParams(max_tokens=24, structured=s, **kw))
    return out


def check_constraint(tok, params: SamplingParams, toks: list[int]) -> None:
    text = tok.decode(toks, skip_special_tokens=True)
    if params.structured["type"] == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def prompts_for(tok, rng, n: int) -> list[list[int]]:
    # Prompts that already hold text of the constraints' shape, so n-gram lookup finds
    # proposals, some the grammar allows and some it does not.
    words = ["ab-12 X", "yes", "no", "cd-3", "maybe so", "xyz-45", 'it\'s "x"']
    return [
        tok.encode(" ".join(rng.choice(words) for _ in range(rng.randrange(4, 10))) + " id:")
        for _ in range(n)
    ]


class _RejectedProposer(Proposer):
    """Proposes a token no constraint here allows ('!' after anything)."""

    def __init__(self, token: int) -> None:
        super().__init__(2)
        self.token = token

    def propose(self, requests):
        return [[self.token, self.token] for _ in requests]


class _OneCleanOracle(OracleProposer):
    """OracleProposer whose first proposal for request `clean` is never corrupted, so that at
    least one proposed token is accepted on every draw (with corruption alone, every proposal
    could be corrupted: a draw where nothing is accepted, rare but possible)."""

    def __init__(self, clean: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clean = clean
        self.clean_done = False

    def propose(self, requests):
        out = super().propose(requests)
        for i, r in enumerate(requests):
            if r.request_id == self.clean and not self.clean_done:
                n = len(r.output_token_ids)
                out[i] = list(self.continuations[r.request_id][n : n + self.k])
                self.clean_done = bool(out[i])
        return out


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_constrained_ngram_equals_spec_off(base, tok, rng, greedy):
    prompts = prompts_for(tok, rng, 6)
    params = constrained(rng, 6, greedy)
    ids = [f"c{int(greedy)}-{i}" for i in range(6)]
    want = collect(base, prompts, params, ids)
    eng = make_engine(NGRAM)
    got = collect(eng, prompts, params, ids)
    for rid, p in zip(ids, params):
        toks, reason, err, _ = got[rid]
        assert err is None and reason == "stop", (reason, err)
        check_constraint(tok, p, toks)
        assert got[rid] == want[rid]


def test_oracle_proposals_truncated_and_accepted(base, tok, rng):
    """Proposals from the constrained output itself (30% corrupted: mostly tokens the grammar
    rejects): accepted runs happen and the output is speculation off's."""
    prompts = prompts_for(tok, rng, 6)
    params = constrained(rng, 6, greedy=rng.random() < 0.5)
    ids = [f"o-{i}" for i in range(6)]
    want = collect(base, prompts, params, ids)
    eng = make_engine(NGRAM)
    # o-0 is a regex request: at least two output tokens (digits are tokens of their own) and
    # the end, so its first decode step proposes its second token, uncorrupted.
    eng.proposer = _OneCleanOracle(
        "o-0", 3, {rid: want[rid][0] for rid in ids}, 0.3, eng.vocab_size, rng.randrange(1 << 30)
    )
    got = collect(eng, prompts, params, ids)
    assert got == want
    for rid, p in zip(ids, params):
        check_constraint(tok, p, got[rid][0])
    st = eng.stats()
    assert st.spec_decode_num_accepted_tokens > 0
    assert st.spec_decode_num_draft_tokens <= st.spec_decode_num_drafts * 3


def test_rejected_proposals_never_verified(base, tok, rng):
    """A proposal the grammar rejects at its first token is dropped before the step: no verify
    row is spent on it, and the output is speculation off's."""
    bang = tok.encode("!", add_special_tokens=False)
    assert len(bang) == 1
    prompts = prompts_for(tok, rng, 4)
    params = constrained(rng, 4, greedy=True)
    ids = [f"r-{i}" for i in range(4)]
    want = collect(base, prompts, params, ids)
    eng = make_engine(NGRAM)
    eng.proposer = _RejectedProposer(bang[0])
    assert collect(eng, prompts, params, ids) == want
    assert eng.stats().spec_decode_num_drafts == 0


def test_mixed_batch_constrained_and_unconstrained(base, tok, rng):
    """Constrained and unconstrained requests, greedy and seeded, verified in the same steps
    (an oracle proposer keeps acceptance high for both kinds)."""
    n = 8
    prompts = prompts_for(tok, rng, n)
    params = []
    for i, p in enumerate(constrained(rng, n, greedy=False)):
        if i % 2 == 1:  # unconstrained neighbours: plain greedy, and seeded with logprobs
            p = (
                SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
                if i % 4 == 1
                else SamplingParams(max_tokens=20, temperature=0.9, seed=i, logprobs=2)
            )
        elif i % 4 == 2:
            p = SamplingParams(max_tokens=24, temperature=0.0, structured=p.structured)
        params.append(p)
    ids = [f"m-{i}" for i in range(n)]
    want = collect(base, prompts, params, ids)
    eng = make_engine(NGRAM)
    # m-1 is plain greedy with ignore_eos: 20 tokens, its first proposal uncorrupted.
    eng.proposer = _OneCleanOracle(
        "m-1", 3, {rid: want[rid][0] for rid in ids}, 0.2, eng.vocab_size, rng.randrange(1 << 30)
    )
    got = collect(eng, prompts, params, ids)
    assert got == want
    for rid, p in zip(ids, params):
        if p.structured is not None:
            check_constraint(tok, p, got[rid][0])
    st = eng.stats()
    assert st.spec_decode_num_accepted_tokens > 0


def test_prompt_logprobs_unchanged_by_speculation(base, tok, rng):
    """Prompt logprobs come from the prefill rows; verify rows of other requests in the same
    steps change neither them nor the tokens."""
    prompts = prompts_for(tok, rng, 4)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=0, logprobs=1),
        SamplingParams(
            max_tokens=12, temperature=0.0, structured={"type": "regex", "value": REGEX}
        ),
    ]
    ids = [f"p-{i}" for i in range(4)]
    want = collect(base, prompts, params, ids)
    eng = make_engine(NGRAM)
    eng.proposer = OracleProposer(3, {rid: want[rid][0] for rid in ids}, 0.0, eng.vocab_size)
    # Staggered arrival: later prompts prefill (with their prompt logprob rows) while earlier
    # ones run verify steps.
    got = collect_staggered(eng, prompts, params, ids)
    assert eng.stats().spec_decode_num_accepted_tokens > 0
    for rid, p in zip(ids, params):
        toks, reason, err, plp = got[rid]
        wt, wr, we, wplp = want[rid]
        assert (toks, reason, err) == (wt, wr, we)
        if p.prompt_logprobs is None:
            assert plp is None
            continue
        assert plp is not None and len(plp) == len(prompts[ids.index(rid)])
        for a, b in zip(plp, wplp):
            assert (a is None) == (b is None)
            if a is None:
                continue
            assert a["rank"] == b["rank"]
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]


def collect_staggered(eng, prompts, params, ids) -> dict[str, tuple]:
    """As collect, with request i added after i * 3 steps."""
    res = {rid: [[], None, None, None] for rid in ids}
    todo = list(zip(ids, prompts, params))
    step = 0
    while todo or eng.has_unfinished_requests():
        if todo and step >= 3 * (len(ids) - len(todo)):
            rid, p, sp = todo.pop(0)
            eng.add_request(rid, p, sp)
        for o in eng.step():
            r = res[o.request_id]
            r[0].extend(o.new_token_ids)
            if o.prompt_logprobs is not None:
                r[3] = o.prompt_logprobs
            if o.finished:
                r[1], r[2] = o.finish_reason, o.error
        step += 1
        assert step < 10_000
    assert eng.check_all_free()
    return {rid: tuple(v) for rid, v in res.items()}


def test_draft_helpers_cross_marker_and_stop(tok):
    """valid_prefix / fill_draft over a draft that completes the structured_after marker, ends
    the grammar with a stop token and goes on: the masks are the sequential matcher's, free
    before the marker and after the stop, the cut is right after the stop, the state is left
    where it was."""
    import numpy as np
    import xgrammar as xgr
    from voltserve.services.executor.grammar import GrammarCompilerPool
    from voltserve.services.executor.grammar_state import GrammarState

    V = json.load(open(checkpoint("qwen2") / "config.json"))["vocab_size"]
    W = (V + 31) // 32
    stop = 2
    pool = GrammarCompilerPool(tok, V, [stop])
    try:
        compiled = pool.compile({"type": "regex", "value": "[0-9]{1,4}"})
        marker = tok.encode("</think>", add_special_tokens=False)
        digits = tok.encode("12", add_special_tokens=False)
        free = tok.encode(" ok", add_special_tokens=False)
        draft = free + marker + digits + [stop] + free
        st = GrammarState(compiled, [stop], marker)
        cut = len(free) + len(marker) + len(digits) + 1
        assert st.valid_prefix(draft) == cut
        assert st.valid_prefix(free + marker + free) == len(free) + len(marker)
        got = np.zeros((len(draft) + 1, W), dtype=np.int32)
        assert st.fill_draft(draft, got, 0) == len(draft) + 1
        assert st.position == 0 and not st.active
        ref = xgr.GrammarMatcher(compiled, override_stop_tokens=[stop])
        lead = len(free) + len(marker)  # rows 0..lead-1: before the marker is complete
        assert (got[:lead] == -1).all()
        want = np.zeros((1, W), dtype=np.int32)
        for j in range(lead, cut):
            ref.fill_next_token_bitmask(want, 0)
            np.testing.assert_array_equal(got[j], want[0])
            assert ref.accept_token(draft[j])
        assert ref.is_terminated()
        assert (got[cut:] == -1).all()  # after the stop: the request has ended
    finally:
        pool.shutdown()
