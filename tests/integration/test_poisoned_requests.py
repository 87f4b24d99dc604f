"""Requests that would take an executor down, on the real CPU stack (separate processes, real
valkey, the official client).

- Non-finite activations: a checkpoint that overflows fp16 on one token
  (tests/overflow_checkpoint.py), served in fp16. The requests holding it get a 500 error object
  naming the cause within seconds; the requests beside them get the tokens the same server gives
  them alone; the executor never dies (its instance id does not change); the executor counts them.
- The crash-loop guard: an executor whose engine crashes on a marked prompt (the test-only
  VOLTSERVE_TEST_CRASH_ON_TOKENS), restarted by a supervisor as `voltserve serve` restarts it.
  The marked request is failed with a 500 at the second death, the requests that were in flight
  with it complete with their undisturbed tokens, and no third executor dies.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import openai
import pytest
import redis
from voltserve.services.executor.crash_hook import ENV as CRASH_ENV
from voltserve.shared import streams

from tests.overflow_checkpoint import POISON, TRIGGER, overflow_checkpoint
from tests.ports import free_port

from .conftest import Stack

VOCAB = 384  # tests/checkpoints.py tokenizer
MARK = POISON + 1  # the prompt token that crashes the engine in the crash-loop stack


def _prompt(rng, n: int, poison_at: int | None = None) -> list[int]:
    plain = [t for t in range(3, VOCAB) if t not in (POISON, MARK, TRIGGER)]
    ids = [rng.choice(plain) for _ in range(n)]
    if poison_at is not None:
        ids[poison_at] = POISON
    return ids


def _client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=stack.base_url() + "/v1", api_key="x", max_retries=0, timeout=120
    )


async def _complete(c, prompt, max_tokens, stream: bool, logprobs: int = 0):
    """(token ids, finish_reason, logprobs) of one greedy completion (logprobs >= 0: the token
    ids come back as labels)."""
    kw = dict(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=logprobs,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    tokens: list[int] = []
    lps: list[float] = []
    finish = None
    if stream:
        chunks = [ch async for ch in await c.completions.create(stream=True, **kw)]
    else:
        chunks = [await c.completions.create(**kw)]
    for ch in chunks:
        for choice in ch.choices:
            finish = choice.finish_reason or finish
            if choice.logprobs is not None:
                tokens += [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
                lps += choice.logprobs.token_logprobs
    return tokens, finish, lps


def _instance(stack: Stack, executor: str) -> str:
    r = redis.Redis.from_url(stack.redis_url)
    try:
        return r.hget(streams.executor_status_key(executor), "instance").decode()
    finally:
        r.close()


def _metric(url: str, name: str) -> float:
    """The sum of a metric's samples in a /metrics page."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def _sse_events(stack: Stack, prompt: list[int]) -> list[str]:
    """The `data:` payloads of one streamed greedy completion, read raw."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        stack.base_url() + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        lines = resp.read().decode().splitlines()
    return [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]


async def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


# ---- non-finite activations ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp16_stack(tmp_path_factory):
    s = Stack(overflow_checkpoint(), tmp_path_factory.mktemp("fp16-overflow"))
    try:
        s.add_scheduler()
        s.add_renderer()
        s.add_executor("executor-0", "--dtype", "float16")
        s.add_gateway()
        s.wait_ready()
        yield s
    finally:
        s.stop()


async def test_nonfinite_requests_get_an_error_and_the_batch_goes_on(fp16_stack, rng) -> None:
    s = fp16_stack
    c = _client(s)
    instance = _instance(s, "executor-0")
    clean = [
        (_prompt(rng, rng.randint(3, 30)), rng.random() < 0.5, rng.choice((0, 2))) for _ in range(4)
    ]
    n = rng.randint(3, 30)
    poisoned = [
        (_prompt(rng, n, rng.randrange(n)), False, 0),
        ([POISON], True, 0),
        (_prompt(rng, n, n - 1), rng.random() < 0.5, 3),
    ]
    ref = [await _complete(c, p, 12, stream, lp) for p, stream, lp in clean]
    assert all(f == "length" and len(t) == 12 and POISON not in t for t, f, _ in ref)

    async def poisoned_call(prompt, stream, lp) -> float:
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            await _complete(c, prompt, 12, stream, lp)
        assert "non-finite" in e.value.message and "float16" in e.value.message
        assert e.value.body["type"] == "internal_server_error"
        return time.monotonic() - t0

    tasks = [_complete(c, p, 12, stream, lp) for p, stream, lp in clean]
    tasks += [poisoned_call(*p) for p in poisoned]
    got = await asyncio.gather(*tasks)
    for (tokens, finish, lps), (want, want_finish, want_lps) in zip(got[: len(clean)], ref):
        assert (tokens, finish) == (want, want_finish)
        assert lps == pytest.approx(want_lps, abs=1e-3)
    assert max(got[len(clean) :]) < 20  # seconds, on a loaded 2-core CI box
    # The body is an OpenAI error object in valid JSON (bare NaN is refused by this parser).
    req = urllib.request.Request(
        s.base_url() + "/v1/completions",
        data=json.dumps(
            {"model": "tiny", "prompt": [POISON, 5], "max_tokens": 3, "logprobs": 2}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 500
    body = json.loads(e.value.read(), parse_constant=lambda x: pytest.fail(f"bare {x} in JSON"))
    assert "non-finite" in body["error"]["message"]
    # The executor never died, and it counted every poisoned request.
    # Mid-stream: one finite token (POISON, right after TRIGGER), then an error event, [DONE].
    events = await asyncio.to_thread(_sse_events, s, _prompt(rng, rng.randint(1, 20)) + [TRIGGER])
    assert events[-1] == "[DONE]", events
    first, error = json.loads(events[0]), json.loads(events[-2])
    assert first["choices"][0]["finish_reason"] is None and first["choices"][0]["text"]
    assert "non-finite" in error["error"]["message"] and error["error"]["code"] == 500
    s.check_alive()
    assert _instance(s, "executor-0") == instance
    name = "voltserve:nonfinite_logits_requests_total"
    await _until(lambda: _metric(s.base_url() + "/metrics", name) == len(poisoned) + 2, 10, name)


# ---- the crash-loop guard ----------------------------------------------------------------------


class Supervisor:
    """Restarts a dead executor, as `voltserve serve` does, and counts the deaths."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.deaths: list[str] = []

    async def run(self) -> None:
        while True:
            for name, p in list(self.stack.procs.items()):
                if name.startswith("executor") and p.poll() is not None:
                    self.deaths.append(name)
                    self.stack.restart(name)
            await asyncio.sleep(0.1)


@pytest.fixture
def crash_stack(tiny_model, tmp_path):
    """(the stack, its scheduler's metrics port)."""
    s = Stack(tiny_model, tmp_path)
    s.env[CRASH_ENV] = str(MARK)
    port = free_port()
    try:
        s.add_scheduler("scheduler-0", "--metrics-port", str(port))
        s.add_renderer()
        s.add_executor()
        s.add_gateway()
        s.wait_ready()
        yield s, port
    finally:
        s.stop()


@pytest.mark.slow  # two executor restarts
async def test_a_request_in_flight_at_two_executor_deaths_is_failed(crash_stack, rng) -> None:
    s, metrics_port = crash_stack
    c = _client(s)
    prompts = [_prompt(rng, rng.randint(3, 30)) for _ in range(3)]
    ref = await asyncio.gather(*(_complete(c, p, 300, True, 0) for p in prompts))
    assert all(f == "length" and len(t) == 300 for t, f, _ in ref)
    sup = Supervisor(s)
    watch = asyncio.create_task(sup.run())
    try:
        # The bystanders stream until the marked request arrives; they are in flight when the
        # executor dies, and again, some of them, when its restart dies.
        streams_ = [
            await c.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=300,
                temperature=0,
                stream=True,
                logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )
            for p in prompts
        ]
        first = [await anext(aiter(st)) for st in streams_]

        async def rest(st, head) -> list[int]:
            tokens = [int(t.removeprefix("token_id:")) for t in head.choices[0].logprobs.tokens]
            async for ch in st:
                for choice in ch.choices:
                    tokens += [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
            return tokens

        bystanders = [asyncio.create_task(rest(st, h)) for st, h in zip(streams_, first)]
        t0 = time.monotonic()
        marked = _prompt(rng, rng.randint(3, 30))
        marked[rng.randrange(len(marked))] = MARK
        with pytest.raises(openai.InternalServerError) as e:
            await c.completions.create(model="tiny", prompt=marked, max_tokens=8)
        assert "executors that died" in e.value.message
        assert time.monotonic() - t0 < 120
        got = await asyncio.wait_for(asyncio.gather(*bystanders), 300)
        assert got == [t for t, _, _ in ref]
        assert sup.deaths == ["executor-0", "executor-0"]
        # The restarted executor serves again, and the marked request killed nothing more.
        s.wait_executor("executor-0", alive=True)
        again = await _complete(c, prompts[0], 5, False)
        assert again[0] == ref[0][0][:5]
        assert sup.deaths == ["executor-0", "executor-0"]
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        assert _metric(metrics, "voltserve:crash_loop_failed_requests_total") == 1
        # The first death took bystanders down with the marked request (they were in flight).
        moved = re.findall(r"failing over (\d+) request", s.logs("scheduler-0", tail=100_000))
        assert len(moved) == 2 and int(moved[0]) > 1, moved
    finally:
        watch.cancel()
