"""A prompt too long for the context, found before it is tokenized in full.

Two checks, both before the one tokenization of the whole text that gives the prompt's ids:

- by its length: a text of more than max_model_len x chars_per_token characters (token_span.py)
  holds at least max_model_len tokens. Nothing is tokenized; a 60 MB prompt costs a len().
- in pieces: a text longer than PIECE_CHARS is tokenized PIECE_CHARS characters at a time and
  the counting stops at the first piece that takes it to the limit, so refusing it costs about
  max_model_len tokens of tokenization whatever its length. A text that stays under the limit
  is then tokenized whole (the pieces only count).

Pieces are cut where a word starts (a space between a non-space and a letter), a boundary of the
pre-tokenizers of byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece vocabularies, where
the count of the pieces equals the count of the whole. A cut elsewhere (a text without spaces)
or a tokenizer that marks each piece's start (SentencePiece's prefix space) can move the count
by a token or two at the cut; CUT_SLACK_TOKENS per cut is taken off before the count refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

# Characters tokenized at a time (about 16k tokens of English; 10-30 ms on a CPU core).
PIECE_CHARS = 1 << 16
# Where no word start is near the end of a piece, it is cut at its length.
_CUT_SEARCH_CHARS = 4096
CUT_SLACK_TOKENS = 8
# Natural text averages 1-5 characters a token. A prompt of more characters than this many per
# token of the context is most likely too long: the gateway counts it before it travels.
EARLY_COUNT_CHARS_PER_TOKEN = 8


def tokens_by_length(n_chars: int, chars_per_token: int | None) -> int:
    """The fewest tokens a text of n_chars characters can have (0 when not bounded)."""
    if chars_per_token is None or n_chars == 0:
        return 0
    return -(-n_chars // chars_per_token)


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """text in consecutive pieces of at most `size` characters, each cut at a word start when
    one is within the last _CUT_SEARCH_CHARS characters."""
    start, n = 0, len(text)
    while start < n:
        end = min(start + size, n)
        if end < n:
            end = _word_start(text, max(start + 1, end - _CUT_SEARCH_CHARS), end) or end
        yield text[start:end]
        start = end


def _word_start(text: str, lo: int, hi: int) -> int | None:
    """The last index p in [lo, hi) where text[p] is a space after a non-space and before a
    letter, or None."""
    p = text.rfind(" ", lo, hi)
    while p > lo:
        if p + 1 < len(text) and text[p + 1].isalpha() and not text[p - 1].isspace():
            return p
        p = text.rfind(" ", lo, p)
    return None


def tokens_at_least(
    count: Callable[[str], int], text: str, limit: int, size: int = PIECE_CHARS
) -> int | None:
    """Count text's tokens piece by piece (`count` tokenizes one piece, no special tokens) and
    stop at the first piece that takes the count, less the slack of its cuts, to `limit`:
    return that count, which the whole text's reaches too. None when the text stays under."""
    total = 0
    for cuts, piece in enumerate(pieces(text, size)):
        total += count(piece)
        sure = total - cuts * CUT_SLACK_TOKENS
        if sure >= limit:
            return sure
    return None
