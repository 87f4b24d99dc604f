"""token_bytes gives each token's own bytes: for the byte-level BPE test tokenizer, the bytes of
any run of tokens put together decode to what the tokenizer decodes for that run, also when a
single token holds only part of a UTF-8 character (where its text alone is U+FFFD)."""

from __future__ import annotations

from voltserve.services.gateway.detokenizer import token_text
from voltserve.services.gateway.token_bytes import token_bytes

from tests.checkpoints import tokenizer


def test_token_bytes_byte_level() -> None:
    tok = tokenizer()
    partial = 0
    for t in range(len(tok)):
        text = token_text(tok, t)
        b = bytes(token_bytes(tok, t, text))
        if t in tok.added_tokens_decoder:
            assert b == text.encode()
            continue
        assert b.decode("utf-8", errors="replace") == text, t
        partial += "\ufffd" in text
    assert partial > 0  # the vocabulary does hold tokens with part of a character
    for s in ("héllo wörld", "日本語のテキスト", "🦙 emoji ñ"):
        ids = tok.encode(s, add_special_tokens=False)
        joined = b"".join(bytes(token_bytes(tok, t, token_text(tok, t))) for t in ids)
        assert joined.decode() == tok.decode(ids) == s
