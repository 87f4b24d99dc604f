"""The engine's one post-processing of a step (LLMEngine._postprocess): the stop rule
(stop_reason) and speculative acceptance, against KVEchoRunner (a real paged token cache, no
model) and the oracle proposer. Stop strings are text and are applied by the gateway's
detokenizer (services/gateway/generate.py), not here."""

from __future__ import annotations

from voltserve.services.executor.engine import LLMEngine, stop_reason
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.request import RunnerOutput, ScheduledRequest, StepPlan
from voltserve.services.executor.spec.oracle import OracleProposer
from voltserve.shared.sampling_params import SamplingParams

from tests.engine.kv_echo_runner import KVEchoRunner, echo_reference

VOCAB = 97


def _engine(k: int = 0, eos: tuple[int, ...] = ()) -> tuple[LLMEngine, KVEchoRunner]:
    runner = KVEchoRunner(64, vocab_size=VOCAB, eos_token_ids=eos)
    spec = {"method": "ngram", "num_speculative_tokens": k} if k else None
    cfg = engine_config(model="none", max_num_batched_tokens=512, speculative_config=spec, seed=5)
    return LLMEngine(cfg, runner=runner), runner


def test_stop_reason_eos_stop_ids_min_tokens_and_length(rng) -> None:
    eng, _ = _engine(eos=(3,))
    stop_id = rng.randrange(4, VOCAB)
    other = next(t for t in range(4, VOCAB) if t != stop_id)
    min_tokens = rng.randint(2, 5)
    max_tokens = rng.randint(min_tokens + 2, 12)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=[stop_id])
    eng.add_request("a", [1, 2], params)
    req = eng.requests["a"]
    for n in range(1, max_tokens + 1):
        req.output_token_ids = [other] * n
        for tok in (3, stop_id):  # EOS and a stop id: "stop" once min_tokens are out
            req.output_token_ids[-1] = tok
            want = "stop" if n >= min_tokens else ("length" if n >= max_tokens else None)
            assert stop_reason(req, tok) == want
        req.output_token_ids[-1] = other
        assert stop_reason(req, other) == ("length" if n >= max_tokens else None)
    eng.add_request("b", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    req = eng.requests["b"]
    req.output_token_ids = [3]
    assert stop_reason(req, 3) is None  # ignore_eos


def test_plain_step_emits_one_token_and_stops_on_eos() -> None:
    """Through the whole step: the sampled token is emitted, EOS ends the request with "stop",
    max_tokens with "length"; the blocks come back."""
    eng, runner = _engine()
    prompt = list(range(10, 30))
    ref = echo_reference(runner, prompt, SamplingParams(max_tokens=8, temperature=0.0), 0, 4096)
    eos_eng, eos_runner = _engine(eos=(ref[2],))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = eos_eng.generate([prompt], params)[0]
    assert outs == ref[: ref.index(ref[2]) + 1]
    assert eng.generate([prompt], params)[0] == ref
    assert eng.check_all_free() and eos_eng.check_all_free()


def _verify_step(eng: LLMEngine, rid: str, spec: list[int], targets: list[int]):
    """One verify step of request rid by hand: slots for the proposals, then the runner's
    output as given (the target's token after each known prefix)."""
    req = eng.requests[rid]
    assert eng.block_manager.append_slots(req, 1 + len(spec))
    plan = StepPlan([ScheduledRequest(req, 1 + len(spec), spec)], 1 + len(spec))
    from voltserve.services.executor.request import SampledToken

    return eng._postprocess(plan, RunnerOutput([SampledToken(t) for t in targets]), [])


def test_acceptance_keeps_the_matching_run_and_the_targets_token(rng) -> None:
    eng, _ = _engine(k=4)
    eng.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=50, temperature=0.0))
    eng.step()  # the prefill and the first token
    req = eng.requests["a"]
    known = req.num_computed_tokens
    spec = [rng.randrange(VOCAB) for _ in range(4)]
    n_acc = rng.randint(0, 4)
    wrong = (spec[n_acc] + 1) % VOCAB if n_acc < 4 else rng.randrange(VOCAB)
    targets = spec[:n_acc] + [wrong] + [rng.randrange(VOCAB) for _ in range(4 - n_acc)]
    before = list(req.output_token_ids)
    (out,) = _verify_step(eng, "a", spec, targets)
    assert out.new_token_ids == spec[:n_acc] + [wrong]
    assert out.finish_reason is None
    assert req.output_token_ids == before + out.new_token_ids
    # The last known token and the accepted proposals are computed; the rest go back.
    assert req.num_computed_tokens == known + n_acc + 1
    assert len(req.block_ids) == eng.block_manager.blocks_needed(req.num_computed_tokens + 1)
    s = eng.stats()
    assert (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens) == (1, 4)
    assert s.spec_decode_num_accepted_tokens == n_acc


def test_an_accepted_run_stops_at_a_stop_token_and_at_max_tokens(rng) -> None:
    """k proposals all accepted, with a stop token (or the max_tokens limit) inside the run:
    emission stops there, and the request finishes with its blocks freed."""
    eng, _ = _engine(k=4)
    stop_id = rng.randrange(VOCAB)
    spec = [rng.choice([t for t in range(VOCAB) if t != stop_id]) for _ in range(4)]
    j = rng.randint(0, 3)
    spec[j] = stop_id
    eng.add_request("s", [7] * 9, SamplingParams(max_tokens=50, stop_token_ids=[stop_id]))
    eng.add_request("m", [8] * 9, SamplingParams(max_tokens=3, ignore_eos=True))
    first = {o.request_id: o for o in eng.step()}["s"]
    if first.new_token_ids == [stop_id]:
        # the first sampled token was already the stop id (an allowed draw): it ended there
        assert first.finish_reason == "stop" and "s" not in eng.requests
        return
    (out,) = _verify_step(eng, "s", spec, spec + [rng.randrange(VOCAB)])
    assert out.new_token_ids == spec[: j + 1] and out.finish_reason == "stop"
    filler = [rng.randrange(VOCAB) for _ in range(4)]
    (out,) = _verify_step(eng, "m", filler, filler + [0])
    assert out.new_token_ids == filler[:2] and out.finish_reason == "length"
    assert not eng.has_unfinished_requests() and eng.check_all_free()


def test_speculation_through_the_engine_equals_spec_off(rng) -> None:
    """Whole steps with an oracle proposer (some proposals wrong): the same tokens and finish
    as without speculation, with EOS and max_tokens ending requests inside accepted runs."""
    plain, runner = _engine()
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0) for _ in prompts]
    want = plain.generate(prompts, params)
    # An EOS id that occurs in some reference output, past its first token.
    eos = next((w[2] for w in want if len(w) > 2), 0)
    plain, _ = _engine(eos=(eos,))
    want = plain.generate(prompts, params)
    eng, _ = _engine(k=rng.randint(1, 4), eos=(eos,))
    cont = {f"generate-1-{i}": w + [rng.randrange(VOCAB)] * 4 for i, w in enumerate(want)}
    eng.proposer = OracleProposer(eng.spec_config.num_speculative_tokens, cont, 0.3, VOCAB, 1)
    assert eng.generate(prompts, params) == want
    assert eng.check_all_free()
    assert eng.stats().spec_decode_num_drafts > 0
