"""One client cannot stall the others, through real services: a body past --max-request-bytes is a
413 without being read and its connection is not held; a prompt that cannot fit is refused
before it is tokenized in full; a small request from another client is answered while long
prompts are refused; every oversized field is a 400 or 413 naming it, never a 5xx.

Two stacks. The shared `stack` has the default body limit and a tokenizer whose characters
bound its tokens (a long prompt is refused by its length). `big` takes bodies up to 128 MiB and
its tokenizer has a Strip normalizer, which can delete text, so no character count bounds its
tokens: its renderer counts long prompts in pieces, the path a 4 MB or 60 MB prompt takes there.

Timing margins, for the CI machine (2 busy cores): a refusal whose target is under 1 s is
asserted under REFUSE_S = 5 s (the time is printed). A small request sent while long prompts
are refused must answer within its measured baseline (the slowest of several sent alone) plus
STALL_S = 1 s, the issue's bound, with no extra allowance. Before these bounds a 4 MB prompt
held the only renderer for seconds and a 60 MB one for about two minutes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from voltserve.services.gateway.body_limits import (
    DRAIN_S,
    MAX_JSON_DEPTH,
    default_max_request_bytes,
)
from voltserve.services.gateway.params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from voltserve.services.gateway.tools import MAX_TOOLS
from voltserve.services.renderer.render import Renderer, position_limit

from tests.checkpoints import tokenizer as ckpt_tokenizer

from .conftest import Stack

MODEL = "tiny"
REFUSE_S = 5.0
STALL_S = 1.0
BIG_BODY = 128 << 20
MB = 1 << 20
SMALL = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def unbounded_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test checkpoint's vocabulary with a normalizer that strips the text's ends: nothing
    bounds how many characters a token stands for (token_span.py)."""
    from tokenizers import normalizers

    tok = copy.deepcopy(ckpt_tokenizer())
    tok.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Strip()]
    )
    d = tmp_path_factory.mktemp("strip-tokenizer")
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def big(tiny_model: Path, unbounded_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Stack(tiny_model, tmp_path_factory.mktemp("big"))
    try:
        s.add_scheduler()
        s.add_renderer("renderer-0", "--tokenizer", str(unbounded_tokenizer))
        s.add_executor()
        s.add_gateway(
            "gateway-0",
            "--tokenizer",
            str(unbounded_tokenizer),
            "--max-request-bytes",
            str(BIG_BODY),
        )
        s.wait_ready()
        assert (
            Renderer(s.model, tokenizer_path=str(unbounded_tokenizer)).span.chars_per_token is None
        )
    except BaseException:
        s.stop()
        raise
    yield s
    s.stop()


def session(stack: Stack) -> aiohttp.ClientSession:
    """One client: its own session, so its connections are its own."""
    return aiohttp.ClientSession(
        base_url=stack.base_url(), timeout=aiohttp.ClientTimeout(total=120)
    )


async def post(http: aiohttp.ClientSession, path: str, raw: bytes) -> tuple[int, Any, float, Any]:
    t0 = time.perf_counter()
    async with http.post(path, data=raw, headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        took = time.perf_counter() - t0
        try:
            body = json.loads(text)
        except ValueError:
            body = text
        return r.status, body, took, r.headers


def error(status: int, body: Any, want: int, param: str | None | bool = False) -> dict:
    """The OpenAI error object of a `want` answer (param checked unless False)."""
    assert status == want, (status, str(body)[:300])
    assert isinstance(body, dict) and set(body) == {"error"}, str(body)[:300]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not False:
        assert err["param"] == param, err
    return err


def words(rng: random.Random, n_bytes: int) -> str:
    """About n_bytes of short words (the shape of the 30-million-word prompt): a random 64 KiB
    of them, repeated."""
    vocab = ["the", "cat", "sat", "on", "a", "mat", "hello", "world", "x"]
    chunk = " ".join(rng.choice(vocab) for _ in range(16_384)) + " "
    return (chunk * (n_bytes // len(chunk) + 1))[:n_bytes]


async def baseline(http: aiohttp.ClientSession, n: int = 8) -> float:
    """The slowest of n small requests sent one after another, with nothing else running."""
    raw = json.dumps(SMALL).encode()
    times = []
    for _ in range(n):
        status, body, took, _ = await post(http, "/v1/completions", raw)
        assert status == 200, body
        times.append(took)
    return max(times)


async def small_requests_during(stack: Stack, busy: asyncio.Task) -> list[float]:
    """Another client's small requests, one after another until `busy` is done (at least 3)."""
    raw = json.dumps(SMALL).encode()
    times: list[float] = []
    async with session(stack) as http:
        while not busy.done() or len(times) < 3:
            status, body, took, _ = await post(http, "/v1/completions", raw)
            assert status == 200, body
            times.append(took)
    return times


# ---- the body limit -------------------------------------------------------------------------


async def test_body_past_the_limit_is_413_unread_and_not_held(stack, rng) -> None:
    r = Renderer(stack.model)
    limit = default_max_request_bytes(position_limit(stack.model), r.span.max_token_bytes)
    empty = len(json.dumps({"model": MODEL, "prompt": "", "max_tokens": 1}))

    def body(size: int) -> bytes:
        raw = json.dumps({"model": MODEL, "prompt": "a" * (size - empty), "max_tokens": 1})
        assert len(raw) == size
        return raw.encode()

    async with session(stack) as http:
        # At the limit: read and answered (the prompt is too long for the context).
        status, out, _, _ = await post(http, "/v1/completions", body(limit))
        error(status, out, 400, "prompt")
        status, out, _, headers = await post(http, "/v1/completions", body(limit + 1))
        assert str(limit) in error(status, out, 413)["message"]
        assert headers.get("Connection", "").lower() == "close"
        # 60 MB of short words: refused in well under the old two minutes.
        huge = json.dumps({"model": MODEL, "prompt": words(rng, 60 * MB)}).encode()
        # (Every route's 413 at limit + 1 byte: test_api_bad_input.py.)
        for path in ("/v1/completions", "/v1/messages"):
            status, out, took, headers = await post(http, path, huge)
            print(f"{path}: 60 MB body refused in {took:.2f} s")
            if path == "/v1/messages":  # Anthropic's error shape
                assert status == 413 and out["error"]["type"] == "request_too_large", out
            else:
                error(status, out, 413)
            assert headers.get("Connection", "").lower() == "close"
            assert took < REFUSE_S, took

        # Chunked (no Content-Length): read up to the limit, no further.
        async def chunks():
            piece = b" " * (64 * 1024)
            for _ in range(limit // len(piece) + rng.randint(2, 20)):
                yield piece

        t0 = time.perf_counter()
        async with http.post("/v1/completions", data=chunks()) as resp:
            error(resp.status, await resp.json(), 413)
        assert time.perf_counter() - t0 < REFUSE_S


def test_413_does_not_wait_for_the_body_nor_hold_the_connection(stack, rng) -> None:
    """A client that announces 60 MB and sends almost none of it gets its 413 at once, and the
    gateway closes the connection within DRAIN_S even though the client keeps it open."""
    port = int(stack.base_url().rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=REFUSE_S + DRAIN_S) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {60 * MB + rng.randint(0, MB)}\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": "' + b"a" * rng.randint(0, 4096))
        t0 = time.perf_counter()
        got = b""
        while b"\r\n\r\n" not in got:
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        assert time.perf_counter() - t0 < REFUSE_S
        while sock.recv(65536):  # the rest of the answer, then the server's close
            pass
        held = time.perf_counter() - t0
        print(f"413 connection closed after {held:.2f} s")
        assert held < DRAIN_S + REFUSE_S


# ---- long prompts ---------------------------------------------------------------------------


async def test_prompt_past_the_character_bound_is_refused_at_the_gateway(stack, rng) -> None:
    r = Renderer(stack.model, stack.limits())
    cpt = r.span.chars_per_token
    assert cpt is not None
    text = "b" * ((r.max_model_len - 1) * cpt + rng.randint(1, 5000))
    async with session(stack) as http:
        raw = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1}).encode()
        status, out, _, _ = await post(http, "/v1/completions", raw)
        assert "at least" in error(status, out, 400, "prompt")["message"]
        status, out, _, _ = await post(http, "/tokenize", raw)
        error(status, out, 400, "prompt")


@pytest.mark.slow  # its own stack
async def test_60mb_prompt_refused_fast_in_pieces(big, rng) -> None:
    """With the limit raised past it, a 60 MB prompt reaches the renderer, whose tokenizer gives
    no character bound: refused after one piece of tokenization."""
    text = words(rng, 60 * MB)
    async with session(big) as http:
        cases = [
            ("/v1/completions", {"model": MODEL, "prompt": text}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
        ]
        for path, body, param in cases:
            raw = json.dumps(body).encode()
            status, out, took, _ = await post(http, path, raw)
            print(f"{path}: 60 MB prompt refused in {took:.2f} s")
            assert "maximum context length" in error(status, out, 400, param)["message"]
            assert took < REFUSE_S, took


@pytest.mark.slow  # its own stack
async def test_small_requests_answer_while_long_prompts_are_refused(big, rng) -> None:
    """Another client's small requests keep their latency (baseline + STALL_S) while a grammar
    is built, and 4 MB prompts and conversations of thousands of turns, too long for the
    context, are refused, three at a time."""
    async with session(big) as http:
        usual = await baseline(http)
    # Built before anything is timed. First a grammar the renderer must build to refuse (its
    # first xgrammar use in a renderer takes seconds): it waits on the large queue alone.
    regex = {"model": MODEL, "prompt": "hi", "guided_regex": "(" * rng.randint(1, 9)}
    raws: list[tuple[str, bytes, Any]] = [("/v1/completions", json.dumps(regex).encode(), False)]
    for _ in range(2):
        text = words(rng, 4 * MB + rng.randint(0, MB))
        body: dict[str, Any] = {"model": MODEL, "prompt": text}
        raws.append(("/v1/completions", json.dumps(body).encode(), "prompt"))
        body = {"messages": [{"role": "user", "content": text}]}
        raws.append(("/v1/chat/completions", json.dumps(body).encode(), "messages"))
        # Little content but thousands of turns: the gateway leaves it to the renderer, whose
        # large queue renders the template and counts it in pieces.
        turns = [{"role": "user", "content": ""}] * rng.randint(5_000, 20_000)
        raws.append(("/v1/chat/completions", json.dumps({"messages": turns}).encode(), "messages"))

    async def refuse_all() -> list[float]:
        sem = asyncio.Semaphore(3)
        async with session(big) as http:

            async def one(path: str, raw: bytes, param: Any) -> float:
                async with sem:
                    status, out, took, _ = await post(http, path, raw)
                    error(status, out, 400, param)
                    return took

            return await asyncio.gather(*(one(*r) for r in raws))

    busy = asyncio.ensure_future(refuse_all())
    smalls = await small_requests_during(big, busy)
    refusals = await busy
    print(f"baseline {usual:.3f} s; small during: {[round(t, 3) for t in smalls]}")
    print(f"grammar, then 4 MB and many-turn refusals: {[round(t, 3) for t in refusals]}")
    assert max(refusals[1:]) < REFUSE_S  # the 4 MB and many-turn ones
    assert max(smalls) <= usual + STALL_S, (usual, smalls)


# ---- every oversized field, with another client's small requests beside them ----------------


def nested(depth: int) -> Any:
    x: Any = 1
    for i in range(depth):
        x = [x] if i % 2 else {"k": x}
    return x


def oversized_cases(rng: random.Random, vocab: int) -> list[tuple[str, bytes, int, Any]]:
    """(path, body, status, param) for one draw of each kind of oversized input (vocab: the
    vocabulary's size); param False: not checked (JSON nested past the parser's recursion names
    no field)."""
    user = [{"role": "user", "content": "hi"}]
    chat = {"model": MODEL, "messages": user, "max_tokens": 2}
    cmp = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    deep = rng.randint(MAX_JSON_DEPTH, 400)
    cases: list[tuple[str, Any, int, Any]] = [
        ("/v1/completions", {**cmp, "prompt": words(rng, rng.randint(1, 8) * MB)}, 400, "prompt"),
        (
            "/v1/completions",
            {**cmp, "prompt": [rng.randrange(vocab) for _ in range(rng.randint(600, 200_000))]},
            400,
            "prompt",
        ),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": words(rng, rng.randint(1, 8) * MB)}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {**chat, "messages": user * rng.randint(2_000, 50_000)},
            400,
            "messages",
        ),
        (
            "/v1/completions",
            {
                **cmp,
                "logit_bias": {str(t): 1 for t in range(MAX_LOGIT_BIAS + rng.randint(1, 10**4))},
            },
            400,
            "logit_bias",
        ),
        (
            "/v1/completions",
            {**cmp, "stop": ["x" * rng.randint(MAX_STOP_CHARS + 1, MB)]},
            400,
            "stop",
        ),
        (
            "/v1/completions",
            {**cmp, "stop": ["s"] * (MAX_STOP_STRINGS + rng.randint(1, 10**5))},
            400,
            "stop",
        ),
        (
            "/v1/completions",
            {**cmp, "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + rng.randint(1, 10**5))},
            400,
            "stop_token_ids",
        ),
        (
            "/v1/chat/completions",
            {**chat, "tools": [fn] * (MAX_TOOLS + rng.randint(1, 5000))},
            400,
            "tools",
        ),
        (
            "/v1/chat/completions",
            {**chat, "chat_template_kwargs": {"x": nested(deep)}},
            400,
            "chat_template_kwargs",
        ),
        (
            "/v1/chat/completions",
            {
                **chat,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": nested(deep)},
                },
            },
            400,
            "response_format",
        ),
        (
            "/v1/completions",
            {
                **cmp,
                "guided_json": json.dumps({"type": "object", "properties": {"a": nested(deep)}}),
            },
            400,
            "guided_json",
        ),
        (
            "/v1/chat/completions",
            {
                **chat,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:," + "A" * rng.randint(1, 4 * MB)},
                            }
                        ],
                    }
                ],
            },
            400,
            "messages",
        ),
        ("/v1/completions", {**cmp, "n": MAX_N + rng.randint(1, 10**9)}, 400, "n"),
        (
            "/v1/completions",
            {**cmp, "n": MAX_N, "max_tokens": rng.randint(10**4, 10**9)},
            400,
            "max_tokens",
        ),
        ("/tokenize", {"prompt": words(rng, rng.randint(1, 8) * MB)}, 400, "prompt"),
        ("/detokenize", {"tokens": [1] * rng.randint(600, 10**6)}, 400, "tokens"),
    ]
    out = [(p, json.dumps(b).encode(), st, param) for p, b, st, param in cases]
    # Nested past the JSON parser's own recursion limit: a 400, never a 500.
    depth = rng.randint(1_000, 100_000)
    out.append(("/v1/completions", b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}", 400, False))
    return out


@pytest.mark.slow  # its own stack
async def test_oversized_inputs_never_5xx_nor_stall_others(big, rng) -> None:
    """Every kind of oversized input, three at a time in random order: each a 4xx naming its
    field, none a 5xx; another client's small requests keep their latency throughout."""
    vocab = len(ckpt_tokenizer())
    cases = oversized_cases(rng, vocab)
    rng.shuffle(cases)
    async with session(big) as http:
        usual = await baseline(http)
    answers: list[tuple[str, int, float]] = []

    async def send_all() -> None:
        sem = asyncio.Semaphore(3)
        async with session(big) as http:

            async def one(path: str, raw: bytes, want: int, param: Any) -> None:
                async with sem:
                    status, out, took, _ = await post(http, path, raw)
                answers.append((path, status, took))
                assert status < 500, (path, status, out)
                error(status, out, want, param)

            await asyncio.gather(*(one(*c) for c in cases))

    busy = asyncio.ensure_future(send_all())
    smalls = await small_requests_during(big, busy)
    await busy
    print(f"baseline {usual:.3f} s; slowest small during: {max(smalls):.3f} s of {len(smalls)}")
    print(f"slowest refusal: {max(answers, key=lambda a: a[2])}")
    assert not [a for a in answers if a[1] >= 500]
    assert max(smalls) <= usual + STALL_S, (usual, sorted(smalls)[-5:])
    big.check_alive()
