"""Speculative decoding on hybrid linear-attention targets (state_rollback.py): greedy with
n-gram or draft-model proposals equals greedy without them, token for token, and is greedy under
transformers (fp32, CPU; teacher-forced: tests/greedy_reference.py), with chunked prefill and
more requests than state slots (slots are reused), on repetitive prompts so that proposals are
both accepted and rejected (the rollback runs); and what is not supported is refused by name."""

from __future__ import annotations

import random

import pytest
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.spec.oracle import OracleProposer
from voltserve.services.executor.state_rollback import VerifyStates
from voltserve.shared.sampling_params import SamplingParams
from voltserve.shared.startup import StartupError

from tests.checkpoints import checkpoint, tokenizer
from tests.engine.test_hybrid_models import hf_model
from tests.greedy_reference import check_greedy_outputs

MAX_NEW = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def engine(arch: str, spec=None) -> LLMEngine:
    # An 8-token budget chunks every prompt; 3 state slots for 6 requests: slots are reused.
    return LLMEngine(
        engine_config(
            model=str(checkpoint(arch)),
            device="cpu",
            dtype="float32",
            speculative_config=spec,
            max_num_batched_tokens=8,
            max_num_seqs=3,
        )
    )


def repetitive_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """A random phrase three times: n-gram lookup finds proposals in them."""
    V = len(tokenizer())
    return [[rng.randrange(V) for _ in range(rng.randrange(4, 10))] * 3 for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_greedy_with_speculation_equals_spec_off_and_transformers(arch: str, rng) -> None:
    prompts = repetitive_prompts(rng, 6)
    want = engine(arch).generate(prompts, PARAMS)
    check_greedy_outputs(hf_model(arch), prompts, want, MAX_NEW)
    eng = engine(arch, NGRAM)
    # n-gram lookup: proposals where a generated token recurs in the prompt or the output (a
    # tiny random model need not do so at every draw, so none may be made: the oracle below
    # makes them every step).
    assert eng.generate(prompts, PARAMS) == want
    st = eng.stats()
    # The target's own greedy output proposed with some tokens corrupted: groups kept in
    # part, so the state is rolled back to a row inside the group.
    ids = [f"generate-{eng._generate_calls + 1}-{i}" for i in range(len(prompts))]
    k = NGRAM["num_speculative_tokens"]
    eng.proposer = OracleProposer(k, dict(zip(ids, want)), 0.3, len(tokenizer()), rng.random())
    assert eng.generate(prompts, PARAMS) == want
    assert eng.check_all_free()
    after = eng.stats()
    accepted = after.spec_decode_num_accepted_tokens - st.spec_decode_num_accepted_tokens
    drafted = after.spec_decode_num_draft_tokens - st.spec_decode_num_draft_tokens
    assert 0 < accepted < drafted


def test_verify_groups_of_different_lengths(rng, monkeypatch) -> None:
    """Eager verify steps whose groups have different row counts (1, 2 or 3 proposals), so the
    verify ops' layout pads the shorter groups; the state is rolled back inside a group."""
    arch = "qwen3_5"
    prompts = repetitive_prompts(rng, 4)

    def wide(spec=None) -> LLMEngine:
        # All four decode together (a budget for their prompts at once; 4 state slots).
        cfg = engine_config(
            model=str(checkpoint(arch)),
            device="cpu",
            dtype="float32",
            speculative_config=spec,
            max_num_batched_tokens=128,
            max_num_seqs=4,
        )
        return LLMEngine(cfg)

    want = wide().generate(prompts, PARAMS)  # what the oracle proposes from
    eng = wide(NGRAM)
    ids = [f"generate-{eng._generate_calls + 1}-{i}" for i in range(len(prompts))]
    oracle = OracleProposer(3, dict(zip(ids, want)))
    V = len(tokenizer())

    class Short(OracleProposer):
        """Request i proposes its true continuation, at most 1 + i % 3 tokens of it (every step
        mixes group lengths), request 1 with its second token wrong (rejected inside the
        group every time)."""

        def propose(self, requests):
            out = []
            for r, p in zip(requests, oracle.propose(requests)):
                i = ids.index(r.request_id)
                p = p[: 1 + i % 3]
                if i == 1 and len(p) == 2:
                    p[1] = (p[1] + 1) % V
                out.append(p)
            return out

    eng.proposer = Short(3, {})
    steps: list[list[int]] = []
    build = VerifyStates.build.__func__

    def spy(cls, *args, **kw):
        v = build(cls, *args, **kw)
        if v is not None:
            steps.append(list(v.num_rows))
        return v

    monkeypatch.setattr(VerifyStates, "build", classmethod(spy))
    check_greedy_outputs(hf_model(arch), prompts, eng.generate(prompts, PARAMS), MAX_NEW)
    assert eng.check_all_free()
    assert any(len(set(n)) > 1 for n in steps), steps
    st = eng.stats()
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens


def test_draft_model_on_a_hybrid_target(rng) -> None:
    # The draft (attention only, the same tokenizer) keeps its own KV; the target's state is
    # rolled back to the tokens the draft's proposals left kept.
    arch = "qwen3_5"
    prompts = repetitive_prompts(rng, 4)
    spec = {"method": "draft_model", "model": str(checkpoint("llama")), "num_speculative_tokens": 3}
    eng = engine(arch, spec)
    check_greedy_outputs(hf_model(arch), prompts, eng.generate(prompts, PARAMS), MAX_NEW)
    assert eng.check_all_free()
    assert eng.stats().spec_decode_num_drafts > 0


def test_unsupported_speculation_is_refused_by_name() -> None:
    path = str(checkpoint("qwen3_5"))
    eagle = {"method": "eagle", "num_speculative_tokens": 2, "model": path}
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM and method 'eagle'"):
        ModelRunner(engine_config(model=path, device="cpu", speculative_config=eagle))
    # A hybrid draft model would need its own state cache and rollback.
    hybrid_draft = {"method": "draft_model", "num_speculative_tokens": 2, "model": path}
    with pytest.raises(StartupError, match="linear-attention state.*draft model"):
        ModelRunner(
            engine_config(
                model=str(checkpoint("llama")), device="cpu", speculative_config=hybrid_draft
            )
        )
