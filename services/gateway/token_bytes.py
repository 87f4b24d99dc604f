"""The bytes of one token, for the `bytes` of chat logprobs.

Decoding a single token of a byte-level BPE vocabulary gives U+FFFD when the token holds part
of a UTF-8 character; its own bytes come from the vocabulary entry through the byte-to-unicode
table GPT-2 style tokenizers use. SentencePiece vocabularies spell raw bytes as <0xNN> and
spaces as U+2581."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's table: printable bytes map to themselves, the others to code points from 256 up.
    keep = list(range(ord("!"), ord("~") + 1))
    keep += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _is_byte_level(tokenizer: Any) -> bool:
    cached = getattr(tokenizer, "_voltserve_byte_level", None)
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = False
    if backend is not None:
        try:
            byte_level = "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("decoder"))
        except (ValueError, AttributeError, TypeError):
            byte_level = False
    try:
        tokenizer._voltserve_byte_level = byte_level
    except AttributeError:
        pass
    return byte_level


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The token's own bytes; `text` (its decoded text) for added and special tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if token_id in added:
        return list(text.encode())
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return list(text.encode())
    if _is_byte_level(tokenizer):
        table = _unicode_to_byte()
        if all(c in table for c in piece):
            return [table[c] for c in piece]
        return list(text.encode())
    m = _BYTE_PIECE.match(piece)
    if m:
        return [int(m.group(1), 16)]
    if "\u2581" in piece:
        return list(piece.replace("\u2581", " ").encode())
    return list(text.encode())
