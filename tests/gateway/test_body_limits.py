"""The gateway's bounds on a request body: the --max-request-bytes flag (declared once, passed on
by `voltserve serve`, its default from the context) and the JSON nesting bound."""

from __future__ import annotations

import json
import random

import pytest
from voltserve.services import launcher
from voltserve.services.gateway import main as gateway_main
from voltserve.services.gateway.body_limits import (
    MAX_JSON_DEPTH,
    REQUEST_OVERHEAD_BYTES,
    check_depth,
    deepest_field,
    default_max_request_bytes,
    nests_deeper,
)
from voltserve.services.gateway.errors import APIError
from voltserve.services.renderer.render import Renderer, position_limit

from tests.checkpoints import checkpoint


def nested(depth: int, rng: random.Random) -> object:
    """A value of exactly `depth` levels of lists and objects (0: a scalar)."""
    x: object = rng.choice([1, "s", None, 2.5])
    for _ in range(depth):
        x = rng.choice([[x], {"k": x}, [0, x, "y"], {"a": 1, "b": x}])
    return x


def test_default_holds_a_full_context_of_any_token(rng) -> None:
    """A prompt of max_model_len copies of any one token, as the openai client's JSON encoder
    writes it (non-ASCII as \\u escapes), fits in the default limit's share for the prompt:
    the rest (REQUEST_OVERHEAD_BYTES) stays free for the other fields."""
    renderer = Renderer(str(checkpoint("qwen2")))
    tok, ctx = renderer.tokenizer, position_limit(str(checkpoint("qwen2")))
    limit = default_max_request_bytes(ctx, renderer.span.max_token_bytes)
    texts = [tok.decode([t]) for t in range(len(tok))]
    texts += ["中文🦙", "é" * 6]  # tokenized into several tokens: fewer copies fit, but do
    for text in rng.sample(texts, 50) + [max(texts, key=lambda t: len(json.dumps(t)))]:
        n = min(ctx, ctx // max(1, len(tok.encode(text, add_special_tokens=False))) or 1)
        body = json.dumps({"model": "m", "prompt": text * n, "max_tokens": 1}).encode()
        envelope = len(json.dumps({"model": "m", "prompt": "", "max_tokens": 1}))
        assert len(body) - envelope <= limit - REQUEST_OVERHEAD_BYTES, (text, len(body), limit)


def test_flag_is_declared_once_and_passed_on(rng) -> None:
    n = rng.randint(1, 1 << 30)
    args = launcher.build_parser().parse_args(["--model", "m", "--max-request-bytes", str(n)])
    gw = next(c for c in launcher.build_children(args, "redis://x") if c.name == "gateway")
    parsed = gateway_main.parse_args(gw.argv[1:])
    assert parsed.max_request_bytes == n
    # Absent: the gateway derives it (None here).
    args = launcher.build_parser().parse_args(["--model", "m"])
    gw = next(c for c in launcher.build_children(args, "redis://x") if c.name == "gateway")
    assert "--max-request-bytes" not in gw.argv
    assert gateway_main.parse_args(gw.argv[1:]).max_request_bytes is None
    for bad in ("0", "-5", "1.5", "lots"):
        with pytest.raises(SystemExit):
            gateway_main.parse_args(["--model", "m", "--max-request-bytes", bad])


def test_nesting_depth(rng) -> None:
    for _ in range(50):
        d = rng.randint(0, 2 * MAX_JSON_DEPTH)
        x = nested(d, rng)
        limit = rng.randint(1, 2 * MAX_JSON_DEPTH)
        assert nests_deeper(x, limit) == (d > limit), (d, limit)
    ok = {"model": "m", "messages": nested(MAX_JSON_DEPTH - 1, rng)}
    assert deepest_field(ok) is None
    bad = {"model": "m", "tools": nested(MAX_JSON_DEPTH, rng), "x": 1}
    assert deepest_field(bad) == "tools"


def test_check_depth_walks_only_bodies_with_enough_brackets(rng) -> None:
    deep = {"prompt": nested(MAX_JSON_DEPTH + rng.randint(0, 9), rng)}
    # Brackets in the raw bytes decide whether it is walked: the real body has enough.
    with pytest.raises(APIError) as e:
        check_depth(b"[" * (MAX_JSON_DEPTH + 1), deep)
    assert e.value.status == 400 and e.value.param == "prompt"
    check_depth(b"[" * MAX_JSON_DEPTH, deep)  # too few brackets for that depth: not walked
    check_depth(b"[" * 10_000, {"prompt": "[" * 10_000})  # brackets inside a string
