"""The output side shared by the Responses and Messages APIs (services/gateway/chat_bridge.py):
chat stream deltas become block events whose texts put together are the blocks of the whole
output, for every way of cutting the text; errors of the chat checks are named the protocol's
way."""

from __future__ import annotations

import json
import random

import pytest
from voltserve.services.gateway.chat_bridge import (
    REASONING,
    TEXT,
    TOOL_CALL,
    Appended,
    BlockStream,
    Closed,
    Opened,
    blocks_of,
    renamed,
)
from voltserve.services.gateway.errors import APIError
from voltserve.services.gateway.reasoning_parsers import REASONING_PARSERS
from voltserve.services.gateway.tool_parsers import TOOL_PARSERS
from voltserve.services.gateway.tools import ChatPlan

TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "search")]
WORDS = ["Paris", "São Paulo", "日本", 'say "hi"', "a}b{c", "<", "</", "x\\y", "  ", "\n"]


def _text(rng: random.Random) -> str:
    """A hermes-format output: maybe reasoning, maybe text, then zero or more tool calls."""
    out = ""
    if rng.random() < 0.7:
        out += "<think>" + " ".join(rng.choices(WORDS, k=rng.randint(0, 6))) + "</think>\n\n"
    out += " ".join(rng.choices(WORDS, k=rng.randint(0, 6)))
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        args = {"city": rng.choice(WORDS), "n": rng.randint(-5, 50)}
        call = {"name": rng.choice(["get_weather", "search"]), "arguments": args}
        out += "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
    return out


def _cut(rng: random.Random, text: str) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _plan(mode: str) -> ChatPlan:
    if mode == "auto":
        return ChatPlan(
            mode="auto",
            tools=TOOLS,
            tool_parser=TOOL_PARSERS["hermes"],
            reasoning=REASONING_PARSERS["qwen3"](),
        )
    return ChatPlan(reasoning=REASONING_PARSERS["qwen3"]())


def _shape(blocks) -> list[tuple]:
    """Blocks without call ids (those are drawn anew by each parse)."""
    return [(b.kind, b.text, b.name) for b in blocks]


@pytest.mark.parametrize("mode", ["auto", "text"])
def test_stream_events_make_the_whole_blocks(rng: random.Random, mode: str) -> None:
    for _ in range(60):
        text = _text(rng)
        plan = _plan(mode)
        whole = blocks_of(plan.output().message(text))
        out, stream = plan.output(), BlockStream()
        pieces = _cut(rng, text)
        where = (text, pieces)
        # Each block: opened once (with no text), appended to, closed once; one open at a time.
        # Checked as the events come, as a writer sees them (an event's block is the live one).
        opened: set[int] = set()
        texts: dict[int, str] = {}
        current = None
        for i, piece in enumerate(pieces):
            events = stream.feed(out.feed(piece, i == len(pieces) - 1))
            if i == len(pieces) - 1:
                events += stream.close()
            for ev in events:
                if isinstance(ev, Opened):
                    assert current is None and ev.index not in opened, where
                    assert ev.block.text == "" and ev.index == len(opened), where
                    opened.add(ev.index)
                    current = ev.index
                elif isinstance(ev, Appended):
                    assert ev.index == current and ev.text, where
                    texts[ev.index] = texts.get(ev.index, "") + ev.text
                    assert ev.block.text == texts[ev.index], where
                else:
                    assert isinstance(ev, Closed) and ev.index == current, where
                    current = None
        assert _shape(stream.blocks) == _shape(whole), where
        assert current is None and opened == set(range(len(whole))), where
        assert [texts.get(i, "") for i in range(len(whole))] == [b.text for b in whole], where
        kinds = [b.kind for b in whole]
        assert kinds == sorted(kinds, key=[REASONING, TEXT, TOOL_CALL].index), where


def test_arguments_of_an_open_call_come_before_new_content() -> None:
    stream = BlockStream()
    stream.feed(
        {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": ""}}]}
    )
    events = stream.feed(
        {
            "content": "after",
            "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}],
        }
    )
    assert [(type(e).__name__, e.index) for e in events] == [
        ("Appended", 0),
        ("Closed", 0),
        ("Opened", 1),
        ("Appended", 1),
    ]
    assert [(b.kind, b.text) for b in stream.blocks] == [(TOOL_CALL, "{}"), (TEXT, "after")]


def test_renamed_names_the_protocol_field() -> None:
    e = renamed(
        APIError(400, "max_tokens must be at least 1, got 0", "max_tokens"),
        {"max_tokens": "max_output_tokens"},
    )
    assert (e.param, e.message) == (
        "max_output_tokens",
        "max_output_tokens must be at least 1, got 0",
    )
    # A message that does not start with the field keeps its text; other fields are untouched.
    e = renamed(APIError(400, "bad stop", "stop"), {"stop": "stop_sequences"})
    assert (e.param, e.message) == ("stop_sequences", "bad stop")
    e = APIError(400, "temperature must be in [0, 2]", "temperature")
    assert renamed(e, {"stop": "stop_sequences"}) is e
    # A longer name that starts with the field's is not the field.
    e = renamed(APIError(400, "stop_token_ids bad", "stop"), {"stop": "stop_sequences"})
    assert e.message == "stop_token_ids bad"
