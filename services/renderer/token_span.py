"""How much text one token of a vocabulary can stand for, read once from the tokenizer.

Two numbers come out of it. `max_token_bytes`, the longest token's text in UTF-8 bytes, sizes
the gateway's default request-body limit. `chars_per_token` bounds how many characters of a
prompt one token can cover, so that a prompt longer than max_model_len x chars_per_token
characters is certainly too long, whatever its tokens: it is refused without being tokenized.

That second bound holds only where the tokenizer keeps every character of the input in some
token: a byte-level or byte-fallback vocabulary (nothing is unknown), a normalizer that never
deletes text (NFC and NFKC compose at most 4 characters into one, which the bound allows for),
a pre-tokenizer that never drops what it splits on, and added tokens that absorb no whitespace
around them. Any other part (a normalizer that strips accents or control characters, a
whitespace pre-tokenizer, an unknown token that can swallow a whole word, a slow tokenizer we
cannot inspect) makes it None, and only the tokenization in pieces bounds a long prompt.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

# The most characters Unicode canonical composition (NFC, NFKC) merges into one: a character's
# canonical decomposition is at most 4 long (U+1F82 GREEK SMALL LETTER ALPHA WITH PSILI AND
# VARIA AND YPOGEGRAMMENI), tests/renderer/test_prompt_length.py checks it against unicodedata.
MAX_COMPOSED = 4

_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_SPIECE_SPACE = "\u2581"
_BYTE_TABLE_END = "\u0144"

# Normalizers that never make the text shorter, and those that shrink it by a bounded factor.
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
# Pre-tokenizers that keep every character of what they split.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


@dataclass(frozen=True)
class TokenSpan:
    max_token_bytes: int  # the longest token's text, in UTF-8 bytes (vocabulary and added tokens)
    chars_per_token: int | None  # most prompt characters one token covers; None: not bounded


def token_span(tokenizer: Any) -> TokenSpan:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return TokenSpan(_slow_max_bytes(tokenizer), None)
    spec = json.loads(backend.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder")) or "ByteLevel" in json.dumps(
        spec.get("pre_tokenizer")
    )
    max_bytes, max_cover = 1, 1
    for piece in backend.get_vocab(with_added_tokens=False):
        if _BYTE_PIECE.match(piece):
            n_bytes, cover = 1, 1
        elif byte_level:
            # Each character of a byte-level piece spells one byte (GPT-2's table maps the
            # bytes to code points below U+0144); anything else counts as its UTF-8 bytes.
            simple = not piece or max(piece) < _BYTE_TABLE_END
            n_bytes = cover = len(piece) if simple else len(piece.encode("utf-8", "replace"))
        else:
            n_bytes = len(piece.replace(_SPIECE_SPACE, " ").encode("utf-8", "replace"))
            cover = len(piece)
        max_bytes, max_cover = max(max_bytes, n_bytes), max(max_cover, cover)
    absorbs = False
    for added in spec.get("added_tokens") or []:
        content = added.get("content") or ""
        max_bytes = max(max_bytes, len(content.encode("utf-8", "replace")))
        max_cover = max(max_cover, len(content))
        absorbs = absorbs or bool(added.get("lstrip") or added.get("rstrip"))
    shrink = _normalizer_shrink(spec.get("normalizer"))
    keeps = (
        not absorbs
        and _model_keeps_text(spec.get("model") or {}, byte_level)
        and _pre_tokenizer_keeps_text(spec.get("pre_tokenizer"))
    )
    return TokenSpan(max_bytes, max_cover * shrink if keeps and shrink is not None else None)


def _slow_max_bytes(tokenizer: Any) -> int:
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max([1] + [len(str(p).encode("utf-8", "replace")) for p in pieces])


def _model_keeps_text(model: dict[str, Any], byte_level: bool) -> bool:
    """Whether every input character ends up in a token of bounded length: no unknown token
    that can stand for a whole word or a run of unknown characters."""
    kind = model.get("type")
    if kind == "BPE":
        unk_fused = model.get("unk_token") is not None and model.get("fuse_unk")
        return byte_level or bool(model.get("byte_fallback")) or not unk_fused
    if kind == "Unigram":
        return bool(model.get("byte_fallback"))
    return False  # WordPiece, WordLevel: an unknown word is one token


def _normalizer_shrink(n: dict[str, Any] | None) -> int | None:
    """How many times shorter the normalizer can make a text (1: never shorter); None when it
    can delete text."""
    if n is None:
        return 1
    kind = n.get("type")
    if kind in _KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return MAX_COMPOSED
    if kind == "Sequence":
        total = 1
        for part in n.get("normalizers") or []:
            f = _normalizer_shrink(part)
            if f is None:
                return None
            total *= f
        return total
    if kind == "Replace":
        pattern, content = n.get("pattern") or {}, n.get("content") or ""
        if "String" in pattern and content:
            return max(1, math.ceil(len(pattern["String"]) / len(content)))
    return None  # BertNormalizer, Strip, StripAccents, Precompiled, a regex Replace, ...


def _pre_tokenizer_keeps_text(p: dict[str, Any] | None) -> bool:
    if p is None:
        return True
    kind = p.get("type")
    if kind in _KEEPING_PRE_TOKENIZERS:
        return True
    if kind == "Split":
        return p.get("behavior") != "Removed"
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(x) for x in p.get("pretokenizers") or [])
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit, ...
