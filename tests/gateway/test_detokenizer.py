"""Incremental detokenization: pieces never contain a broken character and add up to the text."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from voltserve.services.gateway.detokenizer import REPLACEMENT, IncrementalDetokenizer

# Multi-byte characters (2, 3 and 4 bytes in UTF-8) that a small byte-level vocabulary splits.
CHARS = "abc xyz.,\né中文字😀🎉ß∑"


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CHARS) for _ in range(n))


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    rng = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A vocabulary too small to hold every character whole: many spread over several tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Merges are learnt on ASCII only, so multi-byte characters stay split into byte tokens.
    ascii_text = ["".join(rng.choice("abc xyz.,\n") for _ in range(200)) for _ in range(50)]
    tok.train_from_iterator(ascii_text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_characters_do_split_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    # The premise of the other tests: some token alone decodes to a broken character.
    ids = tokenizer.encode("😀🎉中", add_special_tokens=False)
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("trial", range(40))
def test_pieces_are_whole_characters(rng, tokenizer: PreTrainedTokenizerFast, trial: int) -> None:
    text = random_text(rng, rng.randint(1, 60))
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer)
    pieces = []
    i = 0
    while i < len(ids):
        k = rng.randint(1, 3)  # engine steps may carry several tokens
        piece = d.add(ids[i : i + k])
        assert REPLACEMENT not in piece, (text, ids, i)
        pieces.append(piece)
        i += k
    pieces.append(d.flush())
    assert "".join(pieces) == text == tokenizer.decode(ids)


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerFast) -> None:
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    ids = tokenizer.encode("ab中", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer)
    out = d.add(ids[:1]) + d.add([eos]) + d.add(ids[1:]) + d.flush()
    assert out == "ab中"
    d = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    out = d.add(ids[:1]) + d.add([eos]) + d.add(ids[1:]) + d.flush()
    assert out == tokenizer.decode(ids[:1] + [eos] + ids[1:], skip_special_tokens=False)


def test_truncated_character_is_flushed_at_the_end(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("x😀", add_special_tokens=False)
    # Drop the last token so the emoji can never complete.
    d = IncrementalDetokenizer(tokenizer)
    held = d.add(ids[:-1])
    assert REPLACEMENT not in held
    assert held + d.flush() == tokenizer.decode(ids[:-1])


def test_fast_backend_decodes_like_the_tokenizer(rng, tokenizer: PreTrainedTokenizerFast) -> None:
    from voltserve.services.gateway.detokenizer import fast_backend

    backend = fast_backend(tokenizer)
    assert backend is not None  # a plain fast tokenizer takes the direct path
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 8))]
        for skip in (True, False):
            want = tokenizer.decode(ids, skip_special_tokens=skip)
            assert backend.decode(ids, skip_special_tokens=skip) == want
