"""A prompt too long for the context is refused before it is tokenized in full: the character
bound (token_span.py) holds for every token of real tokenizers, the count in pieces
(prompt_length.py) never refuses a prompt that fits, and a 60 MB prompt costs well under a
second either way."""

from __future__ import annotations

import dataclasses
import random
import time
import unicodedata

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from voltserve.services.executor.demo_model import build_tokenizer
from voltserve.services.renderer.prompt_length import (
    PIECE_CHARS,
    pieces,
    tokens_at_least,
    tokens_by_length,
)
from voltserve.services.renderer.render import Renderer, RenderFailed
from voltserve.services.renderer.token_span import MAX_COMPOSED, token_span
from voltserve.shared.protocol import RenderRequest

from tests.checkpoints import checkpoint, limits

# Characters that stress a tokenizer's spans: combining marks (NFC composes them), CJK, emoji
# (4-byte UTF-8, split over byte tokens), whitespace runs, digits, the special tokens' text.
ALPHABET = ["a", "b", "hello", " ", "  ", "\n", "e\u0301", "\u1f00\u0300\u0345", "中文", "🦙"]
ALPHABET += ["7", "12345", "'s", "<|im_start|>", "\t", ".", "ﬁ", "\u0000", "x" * 40]

# Wall-clock bounds for the CI machine (2 busy cores): the work measured is ~0.1 s here.
FAST_S = 5.0


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(str(checkpoint("qwen2")), limits("qwen2"))


def text_of(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def test_max_composed_matches_unicode() -> None:
    most = max(
        len(unicodedata.normalize("NFD", chr(c)))
        for c in range(0x110000)
        if unicodedata.decomposition(chr(c))
    )
    assert most == MAX_COMPOSED


def test_every_token_covers_at_most_the_bound(rng, renderer: Renderer) -> None:
    """Offsets into the original text: no token of a real tokenizer spans more characters than
    chars_per_token, whatever the text (NFC, special tokens, byte pieces included)."""
    tok, span = renderer.tokenizer, renderer.span
    assert span.chars_per_token is not None
    for _ in range(20):
        text = text_of(rng, rng.randint(1, 400))
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        for a, b in enc["offset_mapping"]:
            assert b - a <= span.chars_per_token, (text[a:b], span)
        assert len(enc["input_ids"]) >= tokens_by_length(len(text), span.chars_per_token)
    # max_token_bytes is the longest token's text, in bytes.
    lengths = [
        len(text.encode())
        for text in (tok.decode([tid]) for tid in range(len(tok)))
        if "\ufffd" not in text
    ]
    assert max(lengths) == span.max_token_bytes


def _wrap(tok: Tokenizer, **kw) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


def _sentencepiece_bpe(normalizer=None) -> Tokenizer:
    """A Llama-2-style vocabulary: U+2581 for spaces, byte fallback for the rest."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizer or normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback()])
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>"] + [f"<0x{b:02X}>" for b in range(256)],
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    return tok


def _with_normalizer(tok: Tokenizer, normalizer) -> PreTrainedTokenizerFast:
    copy = Tokenizer.from_str(tok.to_str())
    copy.normalizer = normalizer
    return _wrap(copy)


def test_span_of_other_tokenizers(rng) -> None:
    # Byte fallback: nothing is unknown, every piece covers its own characters.
    base = _sentencepiece_bpe()
    sp = _wrap(base)
    span = token_span(sp)
    assert span.chars_per_token is not None
    for _ in range(10):
        text = text_of(rng, rng.randint(1, 200))
        enc = sp(text, add_special_tokens=False, return_offsets_mapping=True)
        assert all(b - a <= span.chars_per_token for a, b in enc["offset_mapping"])
        assert len(enc["input_ids"]) * span.chars_per_token >= len(text)
    # NFC composes up to MAX_COMPOSED characters into one.
    nfc = token_span(_with_normalizer(base, normalizers.NFC()))
    assert nfc.chars_per_token == span.chars_per_token * MAX_COMPOSED
    # Anything that can drop or swallow text leaves the length unbounded.
    for dropping in (normalizers.StripAccents(), normalizers.Strip(), normalizers.BertNormalizer()):
        assert token_span(_with_normalizer(base, dropping)).chars_per_token is None
    bert = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    bert.pre_tokenizer = pre_tokenizers.Whitespace()
    assert token_span(_wrap(bert, unk_token="[UNK]")).chars_per_token is None
    absorbing = build_tokenizer(300)
    absorbing.add_tokens([_added("<|tool|>", rstrip=True)], special_tokens=True)
    assert token_span(absorbing).chars_per_token is None
    # "<|tool|>" followed by any number of spaces is one token: no bound could hold.
    ids = absorbing.encode("<|tool|>" + " " * rng.randint(50, 500), add_special_tokens=False)
    assert len(ids) == 1


def _added(content: str, **kw):
    from tokenizers import AddedToken

    return AddedToken(content, special=True, **kw)


def test_pieces_cut_at_word_starts(rng) -> None:
    words = [rng.choice(["alpha", "béta", "中文", "42", "x"]) for _ in range(rng.randint(1, 3000))]
    text = " ".join(words)
    size = rng.randint(64, 512)
    parts = list(pieces(text, size))
    assert "".join(parts) == text
    assert all(0 < len(p) <= size for p in parts)
    for p in parts[1:]:
        # Each later piece starts at a space before a word, unless no such space was near.
        assert p[0] == " " and p[1].isalpha() or " " not in p[: size // 2]
    assert list(pieces("", size)) == [] and list(pieces("abc", size)) == ["abc"]


def test_count_in_pieces_never_refuses_what_fits(rng, renderer: Renderer) -> None:
    """tokens_at_least refuses only texts whose whole count reaches the limit."""
    tok = renderer.tokenizer

    def count(piece: str) -> int:
        return len(tok.encode(piece, add_special_tokens=False))

    for _ in range(12):
        text = " ".join(text_of(rng, rng.randint(1, 6)) for _ in range(rng.randint(50, 1500)))
        whole = count(text)
        limit = max(1, whole + rng.randint(-whole // 3, whole // 3))
        size = rng.randint(200, 2000)
        got = tokens_at_least(count, text, limit, size)
        if got is not None:
            assert limit <= got <= whole, (got, whole, limit)
        else:
            assert whole < limit + (len(text) // size + 1) * 8, (whole, limit)


def _with_limit(renderer: Renderer, limit: int, bounded: bool) -> Renderer:
    r = Renderer(str(checkpoint("qwen2")), limits("qwen2", limit), tokenizer=renderer.tokenizer)
    if not bounded:
        r.span = dataclasses.replace(r.span, chars_per_token=None)
    return r


def test_render_refuses_exactly_what_does_not_fit(rng, renderer: Renderer) -> None:
    """Around the limit, a long prompt is refused if and only if its whole tokenization holds
    max_model_len tokens or more (the early checks refuse nothing that fits)."""
    words, size = [], 0
    while size < PIECE_CHARS + 20_000:  # long enough to be counted in pieces
        words.append(text_of(rng, rng.randint(1, 5)))
        size += len(words[-1]) + 1
    text = " ".join(words)
    whole = len(renderer.tokenizer.encode(text))
    for limit in (whole, whole + 1, whole - rng.randint(1, 50)):
        r = _with_limit(renderer, limit, True)
        req = RenderRequest("r", "g", "completion", prompt=text, sampling={"max_tokens": 1})
        if whole >= limit:
            with pytest.raises(RenderFailed) as e:
                r.render(req)
            assert e.value.param == "prompt" and "maximum context length" in e.value.message
        else:
            assert r.render(req)[0].prompt_token_ids == renderer.tokenizer.encode(text)


@pytest.mark.parametrize("bounded", [True, False])
def test_huge_prompt_refused_fast(rng, renderer: Renderer, bounded: bool) -> None:
    """A 60 MB prompt: by its length (no tokenization), or after one piece when the tokenizer
    gives no bound. Chats alike (the template's output)."""
    limit = rng.choice([512, 4096])
    r = _with_limit(renderer, limit, bounded)
    huge = "hello " * 10_000_000
    t0 = time.perf_counter()
    with pytest.raises(RenderFailed) as e:
        r.render(RenderRequest("r", "g", "completion", prompt=huge, sampling={"max_tokens": 1}))
    assert time.perf_counter() - t0 < FAST_S
    assert e.value.param == "prompt" and "at least" in e.value.message
    chat = RenderRequest(
        "c", "g", "chat", messages=[{"role": "user", "content": huge}], sampling={"max_tokens": 1}
    )
    t0 = time.perf_counter()
    with pytest.raises(RenderFailed) as e:
        r.render(chat)
    assert time.perf_counter() - t0 < FAST_S
    assert e.value.param == "messages"
    with pytest.raises(RenderFailed):
        r.tokenize_text(huge, True, "prompt")


def test_prompt_size_checks_cost_no_tokenization(rng, renderer: Renderer) -> None:
    limit, cpt = renderer.max_model_len, renderer.span.chars_per_token
    assert cpt is not None
    renderer.check_prompt_size("x" * ((limit - 1) * cpt))  # may hold limit - 1 tokens
    with pytest.raises(RenderFailed, match="at least"):
        renderer.check_prompt_size("x" * ((limit - 1) * cpt + rng.randint(1, 1000)))
    renderer.check_prompt_size([1] * (limit - 1))
    with pytest.raises(RenderFailed, match=f"has {limit} input tokens"):
        renderer.check_prompt_size([1] * limit)
