"""The stop-string matcher: never releases any part of a stop string, however text is split."""

from __future__ import annotations

import random

import pytest
from voltserve.services.gateway.stop import StopMatcher


def expected(text: str, stops: list[str]) -> tuple[str, bool]:
    """Oracle: the first end position where some stop string completes; the longest one there."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            return text[: end - max(len(s) for s in hits)], True
    return text, False


def split_randomly(rng: random.Random, text: str) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(0, 4)  # empty pieces happen too (a token with no text yet)
        pieces.append(text[i : i + k])
        i += k
    return pieces


@pytest.mark.parametrize("trial", range(300))
def test_random_text_and_stops(rng, trial: int) -> None:
    alphabet = "abcé\n "
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        for _ in range(rng.randint(1, 3))
    ]
    want, want_stopped = expected(text, stops)
    m = StopMatcher(stops)
    released = ""
    for piece in split_randomly(rng, text):
        released += m.feed(piece)
        # Whatever was released so far is a prefix of the final answer: nothing leaked early.
        assert want.startswith(released), (text, stops, released)
        if m.stopped:
            break
    released += m.flush()
    assert released == want, (text, stops)
    assert m.stopped == want_stopped


def test_partial_match_is_held_then_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("hello ST") == "hello "
    assert m.feed("A") == "STA"
    assert m.feed("and ST") == "and "
    assert m.flush() == "ST"


def test_match_across_pieces() -> None:
    m = StopMatcher(["</s>", "\n\n"])
    out = m.feed("abc</") + m.feed("s") + m.feed(">tail")
    assert out == "abc" and m.stopped and m.matched == "</s>"
    assert m.feed("more") == "" and m.flush() == ""


def test_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""
