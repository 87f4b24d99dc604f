"""The pre-encoded chunk template gives exactly the bytes of the JSON encoder's chunk."""

from __future__ import annotations

import random

import pytest
from voltserve.services.gateway.sse import ChunkTemplate, event

ALPHABET = 'ab \n\t"\\/\x00\x01\x1féß中😀\u2028\u2029<>&'


def rand_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12)))


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_template_matches_json_encoder(rng, chat: bool, include_usage: bool) -> None:
    head = {
        "id": "cmpl-" + rand_text(rng),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": rng.randrange(1 << 31),
        "model": rand_text(rng) or "m",
    }
    t = ChunkTemplate(head, chat, include_usage)
    for _ in range(200):
        index = rng.randrange(4)
        text = rand_text(rng)
        finish = rng.choice([None, "stop", "length", "abort"])
        if chat:
            c = {"index": index, "delta": {"content": text} if text else {}}
        else:
            c = {"index": index, "text": text}
        c |= {"logprobs": None, "finish_reason": finish}
        chunk = {**head, "choices": [c]}
        if include_usage:
            chunk["usage"] = None
        assert t.choice(index, text, finish) == event(chunk)
