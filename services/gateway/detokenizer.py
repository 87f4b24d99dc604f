"""Incremental detokenization that never splits a UTF-8 character.

Byte-level tokenizers can spread one character over several tokens; decoding a prefix of them
yields U+FFFD. We therefore decode a short sliding window twice (the text already emitted, and the
same text plus the new tokens) and emit only the difference, and only once it no longer ends in
U+FFFD. The window starts with a primer token so that tokenizers which drop a leading space at the
start of a text (SentencePiece) still emit the space of the first generated word.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(_primer_ids(tokenizer))
        # ids[prefix:read] is text already emitted, kept as context for the next decode.
        self.prefix = 0
        self.read = len(self.ids)
        self._backend = fast_backend(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Feed new token ids; return the newly completed text (maybe empty)."""
        out = []
        for t in token_ids:
            self.ids.append(t)
            out.append(self._step(final=False))
        return "".join(out)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (may contain U+FFFD)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if not final and (after.endswith(REPLACEMENT) or len(after) <= len(before)):
            # An incomplete character (or a token with no text yet): wait for more tokens.
            if len(after) <= len(before) and not after.endswith(REPLACEMENT):
                # No text and nothing pending (e.g. a skipped special token): move on.
                self.read = len(self.ids)
            return ""
        # The common prefix is normally `before` itself; be defensive with odd decoders.
        start = len(before) if after.startswith(before) else _common_prefix_len(before, after)
        self.prefix, self.read = self.read, len(self.ids)
        return after[start:]


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fast_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer when decoding through it
    gives exactly what `tokenizer.decode` gives (no clean-up pass), else None.

    transformers' decode wraps the Rust decode in argument conversion that costs about as much as
    the decode itself; it is called twice per token per request, so this is worth a check."""
    cache = getattr(tokenizer, "_voltserve_fast_backend", _UNSET)
    if cache is not _UNSET:
        return cache
    backend = getattr(tokenizer, "_tokenizer", None)
    ok = backend is not None and hasattr(backend, "decode") and _plain_decode(type(tokenizer))
    if ok and getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers skips the clean-up for BPE models unless forced; mirror that exactly.
        forced = getattr(
            tokenizer,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            True,
        )
        ok = type(backend.model).__name__ == "BPE" and not forced
    result = backend if ok else None
    try:
        tokenizer._voltserve_fast_backend = result
    except AttributeError:
        pass
    return result


_UNSET = object()


def _plain_decode(cls: type) -> bool:
    """The class decodes the way transformers' fast-tokenizer base does (no override)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    return (
        cls.decode is PreTrainedTokenizerBase.decode
        and getattr(cls, "_decode", None) is TokenizersBackend._decode
    )


def _primer_ids(tokenizer: Any) -> list[int]:
    ids = tokenizer.encode("a", add_special_tokens=False)
    return list(ids[-1:]) if ids else []


def token_text(tokenizer: Any, token_id: int) -> str:
    """Text of one token alone (for logprobs); partial characters appear as U+FFFD."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
