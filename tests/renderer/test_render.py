"""The renderer without services: chat templates (sandboxed, equal to transformers), seeds,
eos ids, and vLLM's context-length rules."""

from __future__ import annotations

import random

import pytest
from jinja2.exceptions import SecurityError
from voltserve.services.renderer.chat_template import ChatTemplate, TemplateError
from voltserve.services.renderer.render import Renderer, RenderFailed
from voltserve.shared.protocol import RenderRequest
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, limits


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(str(checkpoint("qwen2")), limits("qwen2"))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["sun", "dog", "é", "中文", "x{y}", "'q'"]) for _ in range(n))


def request(**kw) -> RenderRequest:
    base = dict(request_id="r1", gateway_id="g", kind="completion", prompt="hello there")
    base.update(kw)
    return RenderRequest(**base)


@pytest.mark.parametrize("trial", range(5))
def test_chat_template_equals_transformers(rng, renderer: Renderer, trial: int) -> None:
    roles = ["system"] + ["user", "assistant"] * 3
    messages = [
        {"role": r, "content": words(rng, rng.randint(0, 8))} for r in roles[: rng.randint(1, 7)]
    ]
    for gen in (True, False):
        want = renderer.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )
        assert renderer.chat_prompt(messages, gen) == want


def test_content_parts_are_joined(renderer: Renderer) -> None:
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]
    assert renderer.chat_prompt([{"role": "user", "content": parts}]) == renderer.chat_prompt(
        [{"role": "user", "content": "abcd"}]
    )
    with pytest.raises(RenderFailed):
        renderer.chat_prompt([{"role": "user", "content": [{"type": "image_url"}]}])


def test_template_helpers_and_sandbox() -> None:
    t = ChatTemplate(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages[0] | tojson }}{{ extra }}",
        {},
    )
    assert (
        t.render([{"role": "user", "content": "é"}], extra="!")
        == '{"role": "user", "content": "é"}!'
    )
    with pytest.raises(TemplateError, match="one message only"):
        t.render([{"role": "user", "content": "a"}] * 2)
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises((TemplateError, SecurityError)):
        evil.render([{"role": "user", "content": "a"}])
    # The immutable sandbox refuses to mutate what it is given.
    with pytest.raises((TemplateError, SecurityError)):
        ChatTemplate("{{ messages.append(1) }}", {}).render([{"role": "user", "content": "a"}])


def test_seeds_and_eos(renderer: Renderer) -> None:
    seed = random.randrange(1 << 40)
    out = renderer.render(request(n=3, sampling=SamplingParams(seed=seed).to_dict()))
    assert [e.request_id for e in out] == ["r1.0", "r1.1", "r1.2"]
    assert [e.sampling["seed"] for e in out] == [seed, seed + 1, seed + 2]
    assert out[0].sampling["eos_token_ids"] == list(renderer.eos_token_ids) != []
    drawn = [e.sampling["seed"] for e in renderer.render(request(n=4))]
    assert len(set(drawn)) == 4 and all(0 <= s < (1 << 63) for s in drawn)


def test_context_length_rules(rng, renderer: Renderer) -> None:
    limit = renderer.max_model_len
    n = rng.randint(10, limit - 10)
    ids = [rng.randrange(3, renderer.vocab_size) for _ in range(n)]
    with pytest.raises(RenderFailed) as e:
        renderer.render(request(prompt=[1] * limit))
    assert str(limit) in e.value.message and e.value.param == "prompt"
    big = SamplingParams(max_tokens=limit - n + 1).to_dict()
    with pytest.raises(RenderFailed) as e:
        renderer.render(request(prompt=ids, sampling=big))
    assert e.value.param == "max_tokens" and str(limit + 1) in e.value.message
    (out,) = renderer.render(request(prompt=ids, sampling=big, max_tokens_explicit=False))
    assert out.sampling["max_tokens"] == limit - n
    exact = SamplingParams(max_tokens=limit - n).to_dict()
    assert renderer.render(request(prompt=ids, sampling=exact))[0].prompt_token_ids == ids
    with pytest.raises(RenderFailed) as e:
        renderer.render(request(prompt=[renderer.vocab_size]))
    assert e.value.param == "prompt"


def test_render_many_equals_one_by_one(rng, renderer: Renderer) -> None:
    """A mixed batch (text and token-id completions, chat, and requests that cannot render)
    gives each request what render() gives it alone, in order; the texts' ids equal the
    tokenizer's own encode of each text."""
    tok = renderer.tokenizer
    reqs, want_ids = [], []
    for i in range(rng.randrange(8, 24)):
        kind = rng.choice(["text", "ids", "chat", "empty", "bad_id", "bad_kind"])
        rid = f"r{i}"
        if kind == "text":
            text = words(rng, rng.randrange(1, 60))
            reqs.append(request(request_id=rid, prompt=text))
            want_ids.append(tok.encode(text, add_special_tokens=True))
        elif kind == "ids":
            ids = [rng.randrange(renderer.vocab_size) for _ in range(rng.randrange(1, 30))]
            reqs.append(request(request_id=rid, prompt=ids))
            want_ids.append(ids)
        elif kind == "chat":
            msgs = [{"role": "user", "content": words(rng, rng.randrange(1, 30))}]
            reqs.append(request(request_id=rid, kind="chat", messages=msgs, prompt=None))
            want_ids.append(tok.encode(renderer.chat_prompt(msgs), add_special_tokens=False))
        elif kind == "empty":
            reqs.append(request(request_id=rid, prompt=""))
            want_ids.append(RenderFailed)
        elif kind == "bad_id":
            reqs.append(request(request_id=rid, prompt=[renderer.vocab_size]))
            want_ids.append(RenderFailed)
        else:
            reqs.append(request(request_id=rid, kind="speech"))
            want_ids.append(RenderFailed)
    many = renderer.render_many(reqs)
    assert len(many) == len(reqs)
    for req, got, want in zip(reqs, many, want_ids, strict=True):
        if want is RenderFailed:
            assert isinstance(got, RenderFailed), (req.request_id, got)
            with pytest.raises(RenderFailed) as e:
                renderer.render(req)
            assert (e.value.status, e.value.message) == (got.status, got.message)
            continue
        assert not isinstance(got, Exception), (req.request_id, got)
        assert [er.request_id for er in got] == [f"{req.request_id}.0"]
        assert got[0].prompt_token_ids == list(want)
        alone = renderer.render(req)
        assert alone[0].prompt_token_ids == got[0].prompt_token_ids
        # Equal but the seed, which each render draws when the request gives none.
        assert {**alone[0].sampling, "seed": 0} == {**got[0].sampling, "seed": 0}
