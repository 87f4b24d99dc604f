"""Structured outputs in the engine: xgrammar constraints on a tiny random-weight model.

The constraint alone makes the output valid (random weights, temperature 1.0): every seeded
sample of a regex or choice constraint matches it, JSON-schema outputs validate, a failed
compilation ends the request with an error (never a hang), structured_after starts the
constraint only after its marker, and a resumed (failed-over) request continues exactly.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint


@pytest.fixture(scope="module")
def model_dir():
    return checkpoint("qwen2")


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=512, max_num_seqs=128
    )
    return LLMEngine(cfg)


def run(engine: LLMEngine, prompts, params, outputs=None):
    """Run to completion; [(tokens, finish_reason, error)] per prompt."""
    ids = [f"t{run.n}-{i}" for i in range(len(prompts))]
    run.n += 1
    res = {rid: [[], None, None] for rid in ids}
    for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
        out = outputs[i] if outputs else None
        engine.add_request(rid, prompt, p, output_token_ids=out)
    pending = set(ids)
    for _ in range(100_000):
        if not pending:
            break
        for o in engine.step():
            if o.request_id in res:
                r = res[o.request_id]
                r[0].extend(o.new_token_ids)
                if o.finished:
                    r[1], r[2] = o.finish_reason, o.error
                    pending.discard(o.request_id)
    assert not pending, "requests did not finish"
    return [tuple(res[rid]) for rid in ids]


run.n = 0


def text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def test_regex_holds_on_100_seeded_samples(engine, tok, rng):
    pattern = r"[a-z]{2,4}-[0-9]{1,2}( [A-Z])?"
    base = rng.randrange(1 << 30)
    prompt = tok.encode("id please:")
    params = [
        SamplingParams(
            max_tokens=64,
            temperature=1.0,
            seed=base + i,
            structured={"type": "regex", "value": pattern},
        )
        for i in range(100)
    ]
    for toks, reason, err in run(engine, [prompt] * 100, params):
        assert err is None and reason == "stop", (reason, err)
        assert re.fullmatch(pattern, text(tok, toks)), text(tok, toks)
        assert toks[-1] in engine.eos_token_ids  # the grammar ended with the model's eos


def test_choice_holds_on_100_seeded_samples(engine, tok, rng):
    choices = ["yes", "no", "maybe", 'it\'s "x"']
    base = rng.randrange(1 << 30)
    prompt = tok.encode("answer:")
    params = [
        SamplingParams(
            max_tokens=32,
            temperature=1.0,
            top_p=0.9,
            seed=base + i,
            structured={"type": "choice", "value": choices},
        )
        for i in range(100)
    ]
    seen = set()
    for toks, reason, _ in run(engine, [prompt] * 100, params):
        assert reason == "stop"
        assert text(tok, toks) in choices
        seen.add(text(tok, toks))
    assert len(seen) > 1  # sampled, not one forced path


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["id"],
        },
    },
    "required": ["name", "kind", "tags", "owner"],
}


def test_json_schema_outputs_validate(engine, tok, rng):
    base = rng.randrange(1 << 30)
    c = {"type": "json", "value": json.dumps(SCHEMA)}
    params = [
        SamplingParams(max_tokens=512, temperature=1.0, seed=base + i, structured=c)
        for i in range(2)
    ]
    for toks, reason, _ in run(engine, [tok.encode("json:")] * 2, params):
        assert reason == "stop", text(tok, toks)
        jsonschema.validate(json.loads(text(tok, toks)), SCHEMA)


def test_json_object_and_max_tokens_cut(engine, tok):
    prompt = tok.encode("obj:")
    (toks, reason, _), (cut, cut_reason, _) = run(
        engine,
        [prompt, prompt],
        [
            # A bias on "}" makes the object close as soon as the grammar allows it.
            SamplingParams(
                max_tokens=64,
                temperature=0.0,
                logit_bias={tok.convert_tokens_to_ids("}"): 100.0},
                structured={"type": "json_object", "value": None},
            ),
            SamplingParams(
                max_tokens=3,
                temperature=1.0,
                seed=5,
                structured={"type": "json", "value": json.dumps(SCHEMA)},
            ),
        ],
    )
    assert reason == "stop" and isinstance(json.loads(text(tok, toks)), dict)
    # max_tokens cuts the JSON: finish_reason length, the text a prefix of a valid output.
    assert cut_reason == "length" and len(cut) == 3 and text(tok, cut).startswith("{")


def test_grammar_ebnf(engine, tok, rng):
    ebnf = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-c]{1,4} | "(" [0-9] ")"'
    base = rng.randrange(1 << 30)
    params = [
        SamplingParams(
            max_tokens=64,
            temperature=1.0,
            seed=base + i,
            structured={"type": "grammar", "value": ebnf},
        )
        for i in range(10)
    ]
    for toks, reason, _ in run(engine, [tok.encode("list:")] * 10, params):
        assert reason == "stop"
        assert re.fullmatch(
            r"\[([a-c]{1,4}|\([0-9]\))(,([a-c]{1,4}|\([0-9]\))){0,3}\]", text(tok, toks)
        )


def test_seeded_constrained_sample_is_batch_invariant(engine, tok, rng):
    seed = rng.randrange(1 << 30)
    c = {"type": "regex", "value": "[a-z]{3,10}[0-9]{2}"}
    p = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured=c)
    (alone, _, _) = run(engine, [tok.encode("w:")], [p])[0]
    others = [SamplingParams(max_tokens=8, temperature=1.0, seed=seed + 1 + i) for i in range(4)]
    batch = run(engine, [tok.encode("w:")] + [tok.encode("x y z")] * 4, [p] + others)
    assert batch[0][0] == alone


def test_failover_resume_continues_exactly(engine, tok, rng):
    seed = rng.randrange(1 << 30)
    c = {
        "type": "json",
        "value": json.dumps({"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 4}),
    }
    p = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured=c)
    prompt = tok.encode("json:")
    (full, reason, _) = run(engine, [prompt], [p])[0]
    assert reason == "stop"
    k = len(full) // 2
    (rest, reason2, _) = run(engine, [prompt], [p], outputs=[full[:k]])[0]
    assert full[:k] + rest == full and reason2 == reason
    # Tokens given with the request that break the constraint: an error, not a wrong output.
    bad = tok.encode("not json")
    (_, r3, err) = run(engine, [prompt], [p], outputs=[bad])[0]
    assert r3 == "error" and "does not follow" in err


def test_compile_failure_is_an_error_and_others_go_on(engine, tok):
    prompt = tok.encode("x")
    res = run(
        engine,
        [prompt, prompt],
        [
            SamplingParams(max_tokens=8, structured={"type": "regex", "value": "[a-"}),
            SamplingParams(max_tokens=8, temperature=0.0),
        ],
    )
    (_, r1, err), (toks, r2, _) = res
    assert r1 == "error" and "regex" in err
    assert r2 == "length" and len(toks) == 8
    assert engine.check_all_free()


def test_abort_while_compiling(engine, tok):
    big = {"type": "json", "value": json.dumps({**SCHEMA, "description": "abort me"})}
    engine.add_request("abort-me", tok.encode("x"), SamplingParams(max_tokens=8, structured=big))
    outs = engine.abort_request("abort-me")
    assert [o.finish_reason for o in outs] == ["abort"]
    for _ in range(50):  # the compile finishing later must not resurrect it
        assert not engine.step()
        if not engine._compiling:
            break
    assert not engine.has_unfinished_requests() and engine.check_all_free()


def test_structured_after_marker(engine, tok):
    """The constraint applies only after the marker: before it the output is free."""
    marker = tok.encode("</think>", add_special_tokens=False)
    assert len(marker) >= 2
    digits = {"type": "regex", "value": "[0-9]{1,4}"}
    prompt = tok.encode("think:")
    # The marker's first token pushed by a bias, never followed by the rest: never active, so
    # the bias wins every step (a digits-only mask would forbid this token).
    m0 = marker[0]
    free = SamplingParams(
        max_tokens=6,
        temperature=0.0,
        logit_bias={m0: 100.0},
        structured=digits,
        structured_after=marker,
    )
    # Resumed after "reasoning" that ends with the marker: what follows is constrained.
    after = SamplingParams(
        max_tokens=40,
        temperature=1.0,
        seed=3,
        logit_bias={m0: 100.0},
        structured=digits,
        structured_after=marker,
    )
    (a, ra, _), (b, rb, _) = run(
        engine, [prompt, prompt], [free, after], outputs=[None, [m0, m0] + marker]
    )
    assert a == [m0] * 6 and ra == "length"
    assert rb == "stop" and re.fullmatch("[0-9]{1,4}", text(tok, b))


def test_fill_draft_matches_sequential_masks(model_dir, tok):
    """Speculative decoding's view: the masks after 0..k draft tokens, and rollback."""
    import xgrammar as xgr
    from voltserve.services.executor.grammar import GrammarCompilerPool
    from voltserve.services.executor.grammar_state import GrammarState

    cfg = json.load(open(model_dir / "config.json"))
    pool = GrammarCompilerPool(tok, cfg["vocab_size"], [2])
    compiled = pool.compile({"type": "regex", "value": "ab(c|d)+e"})
    draft = tok.encode("abcdde", add_special_tokens=False)
    W = (cfg["vocab_size"] + 31) // 32
    st = GrammarState(compiled, [2])
    got = np.zeros((len(draft) + 1, W), dtype=np.int32)
    assert st.fill_draft(draft, got, 0) == len(draft) + 1
    assert st.position == 0
    want = np.zeros_like(got)
    ref = xgr.GrammarMatcher(compiled, override_stop_tokens=[2])
    for j in range(len(draft) + 1):
        ref.fill_next_token_bitmask(want, j)
        if j < len(draft):
            assert ref.accept_token(draft[j])
    np.testing.assert_array_equal(got, want)
    # Accept three, roll back two: the next mask is the one after the first token.
    for t in draft[:3]:
        assert st.accept(t)
    st.rollback(2)
    one = np.zeros((1, W), dtype=np.int32)
    st.fill(one, 0)
    np.testing.assert_array_equal(one[0], want[1])
    pool.shutdown()


def test_sampler_masks_before_logprobs(engine, tok):
    """Logprobs of a constrained row are those of the masked distribution: every top token is
    allowed, and the chosen token's logprob is finite."""
    c = {"type": "choice", "value": ["yes", "no"]}
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=1, logprobs=5, structured=c)
    engine.add_request("lp", tok.encode("q:"), p)
    first = None
    while first is None:
        for o in engine.step():
            if o.request_id == "lp" and o.new_token_ids:
                first = o
    allowed = {tok.encode(s, add_special_tokens=False)[0] for s in ("yes", "no")}
    allowed |= {t for t in range(len(tok)) if tok.decode([t]) in ("y", "n", "ye")}
    lp = first.new_logprobs[0]
    assert torch.isfinite(torch.tensor(lp.logprob))
    finite = [t for t, v in lp.top_logprobs if v > float("-inf")]
    assert set(finite) <= allowed and first.new_token_ids[0] in allowed
    engine.abort_request("lp")


def test_structural_tag_formats_compile(model_dir, tok):
    """Both structural-tag formats (vLLM's first one with structures/triggers, and xgrammar's
    {"type": "structural_tag", "format": ...}) compile; a malformed one is a ConstraintError."""
    import xgrammar as xgr
    from voltserve.services.executor.grammar import GrammarCompilerPool
    from voltserve.shared.structured import ConstraintError

    cfg = json.load(open(model_dir / "config.json"))
    pool = GrammarCompilerPool(tok, cfg["vocab_size"], [2])
    args = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    legacy = {
        "structures": [{"begin": "<f=a>", "schema": args, "end": "</f>"}],
        "triggers": ["<f="],
    }
    new = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<f="],
            "tags": [
                {
                    "begin": "<f=a>",
                    "content": {"type": "json_schema", "json_schema": args},
                    "end": "</f>",
                }
            ],
        },
    }
    for v in (legacy, new):
        compiled = pool.compile({"type": "structural_tag", "value": json.dumps(v)})
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string('hi <f=a>{"x": 1}</f>')
        assert not xgr.GrammarMatcher(compiled).accept_string('<f=a>{"x": "no"}')
    with pytest.raises(ConstraintError, match="structural_tag"):
        pool.compile({"type": "structural_tag", "value": json.dumps({"structures": []})})
    pool.shutdown()
