"""Tool-call and reasoning parsers on text: each format's whole-text parse, and its streamed
deltas put back together equal that parse for every way of cutting the text (seeded draws;
VS_TOOL_SEED overrides the seed)."""

from __future__ import annotations

import json
import os
import random

import pytest
from voltserve.services.gateway.reasoning_parsers import REASONING_PARSERS
from voltserve.services.gateway.tool_parsers import TOOL_PARSERS

SEED = int(os.environ.get("VS_TOOL_SEED", "1234"))
DRAWS = 40

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "extra": {"type": "object"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "tags": {"type": "array"}},
            },
        },
    },
]

TRICKY = ["Paris", "São Paulo", 'say "hi"', "a}b{c", "<tool_call>?", "x\\y", "日本", "1 < 2", ""]


def _args(rng: random.Random, name: str) -> dict:
    if name == "get_weather":
        a = {"city": rng.choice(TRICKY)}
        if rng.random() < 0.6:
            a["days"] = rng.randint(-3, 30)
        if rng.random() < 0.5:
            a["metric"] = rng.random() < 0.5
        if rng.random() < 0.3:
            a["extra"] = {"k": [1, {"z": rng.choice(TRICKY)}], "n": None}
        return a
    a = {"query": rng.choice(TRICKY)}
    if rng.random() < 0.5:
        a["tags"] = [rng.choice(TRICKY) for _ in range(rng.randint(0, 3))]
    return a


def _draw_calls(rng: random.Random, most: int = 3) -> list[tuple[str, dict]]:
    names = [t["function"]["name"] for t in TOOLS]
    return [(n, _args(rng, n)) for n in rng.choices(names, k=rng.randint(1, most))]


def _dumps(rng: random.Random, x) -> str:
    # Models write JSON with varying whitespace; the parsers keep it as written.
    if rng.random() < 0.5:
        return json.dumps(x, ensure_ascii=rng.random() < 0.5)
    return json.dumps(x, indent=rng.choice([None, 1, 2]), separators=(",", ": "))


def render(fmt: str, rng: random.Random, before: str, calls, after: str) -> str:
    if fmt == "hermes":
        blocks = [
            f"<tool_call>\n{_dumps(rng, {'name': n, 'arguments': a})}\n</tool_call>"
            for n, a in calls
        ]
        return before + "\n".join(blocks) + after
    if fmt == "llama3_json":
        key = rng.choice(["parameters", "arguments"])
        tag = rng.choice(["", "<|python_tag|>"])
        return tag + "; ".join(_dumps(rng, {"name": n, key: a}) for n, a in calls)
    if fmt == "mistral":
        if rng.random() < 0.5:
            return (
                before
                + "[TOOL_CALLS]"
                + _dumps(rng, [{"name": n, "arguments": a} for n, a in calls])
            )
        return before + "".join(f"[TOOL_CALLS]{n}[ARGS]{_dumps(rng, a)}" for n, a in calls)
    if fmt == "qwen3_coder":
        blocks = []
        for n, a in calls:
            ps = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                for k, v in a.items()
            )
            blocks.append(f"<tool_call>\n<function={n}>\n{ps}</function>\n</tool_call>")
        return before + "\n".join(blocks) + after
    raise AssertionError(fmt)


def stream(parser, text: str, cuts: list[int]):
    st = parser.streamer()
    content, calls = "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for k, p in enumerate(pieces):
        d = st.feed(p, final=k == len(pieces) - 1)
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            i = tc["index"]
            if i == len(calls):
                # The first delta of a call carries its id, type and whole name.
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                calls.append([tc["function"]["name"], ""])
            else:
                assert "name" not in tc["function"] and "id" not in tc
            calls[i][1] += tc["function"].get("arguments", "")
    return content, calls


def _cuts(rng: random.Random, text: str, how: str) -> list[int]:
    if how == "chars":
        return list(range(1, len(text)))
    if how == "whole":
        return []
    return sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "qwen3_coder"])
def test_parse_and_stream_agree(fmt: str) -> None:
    rng = random.Random(f"{SEED}-{fmt}")
    parser = TOOL_PARSERS[fmt](TOOLS)
    for draw in range(DRAWS):
        calls = _draw_calls(rng)
        before = rng.choice(["", "Let me check. ", "Sure!\n", "<tool", "a [TOOL x"])
        after = rng.choice(["", " Done.", "\n"]) if fmt in ("hermes", "qwen3_coder") else ""
        if fmt == "llama3_json":
            before = ""
        text = render(fmt, rng, before, calls, after)
        where = f"seed {SEED} draw {draw} ({fmt}): {text!r}"
        content, parsed = parser.parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls, where
        outside = "\n".join(x.strip() for x in (before, after) if x.strip())
        assert content == (outside or None), where
        for how in ("chars", "random", "whole"):
            s_content, s_calls = stream(parser, text, _cuts(rng, text, how))
            assert s_content == (content or ""), (how, where)
            assert s_calls == [[c.name, c.arguments] for c in parsed], (how, where)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "qwen3_coder"])
def test_plain_text_is_content(fmt: str) -> None:
    parser = TOOL_PARSERS[fmt](TOOLS)
    for text in ["Hello there.", "  The answer is 42 < 43. ", "<b>bold</b>"]:
        content, calls = parser.parse(text)
        assert calls == [] and content == text.strip()
        s_content, s_calls = stream(parser, text, list(range(1, len(text))))
        assert s_calls == [] and s_content == text.strip()


def test_malformed_call_is_content() -> None:
    p = TOOL_PARSERS["hermes"](TOOLS)
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert p.parse(text) == (text, [])
    text = '<tool_call>{"arguments": {}}</tool_call>'  # no name
    assert p.parse(text) == (text, [])


def test_qwen3_coder_types_follow_the_schema() -> None:
    p = TOOL_PARSERS["qwen3_coder"](TOOLS)
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n7\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        '<parameter=extra>\n{"a": [1]}\n</parameter>\n</function>\n</tool_call>'
    )
    _, calls = p.parse(text)
    assert json.loads(calls[0].arguments) == {
        "city": "42",  # a string parameter stays a string
        "days": 7,
        "metric": True,
        "extra": {"a": [1]},
    }


REASONING_CASES = {
    "qwen3": [
        ("<think>\nI should greet.\n</think>\n\nHello!", "\nI should greet.\n", "Hello!"),
        ("Hello!", None, "Hello!"),
        ("<think>still thinking", "still thinking", None),
        ("<think></think>Hi", None, "Hi"),
    ],
    "deepseek_r1": [
        ("I should greet.</think>Hello!", "I should greet.", "Hello!"),
        ("<think>I should greet.</think>\n\nHello!", "I should greet.", "Hello!"),
        ("no end tag", "no end tag", None),
    ],
}


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_reasoning_split_and_stream(name: str) -> None:
    rng = random.Random(f"{SEED}-{name}")
    parser = REASONING_PARSERS[name]()
    for text, reasoning, content in REASONING_CASES[name]:
        assert parser.split(text) == (reasoning, content), text
        for how in ("chars", "random", "whole"):
            cuts = _cuts(rng, text, how)
            st = parser.streamer()
            r, c = "", ""
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            for k, piece in enumerate(pieces):
                dr, dc = st.feed(piece, final=k == len(pieces) - 1)
                r, c = r + dr, c + dc
            assert (r or None, c or None) == (reasoning, content), (how, text)
