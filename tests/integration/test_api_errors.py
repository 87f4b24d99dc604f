"""Errors a client sees from a stack that cannot serve: 401 without the API key, 503 "starting"
on /health with no executor, 503 when the scheduler's admission queue is full (after the only
executor is gone: the limits it published stay known, so requests queue for the next one)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from .conftest import Stack

KEY = "sk-test-" + str(time.time_ns())


@pytest.fixture(scope="module")
def no_executor_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Stack(tiny_model, tmp_path_factory.mktemp("noexec"))
    try:
        s.add_scheduler("scheduler-0", "--max-queued-requests", "1")
        s.add_renderer()
        s.add_gateway("gateway-0", "--api-key", KEY)
        deadline = time.monotonic() + 120
        while True:
            s.check_alive()
            try:
                urllib.request.urlopen(s.base_url() + "/health", timeout=1)
            except urllib.error.HTTPError:
                break  # answering (503 while no executor is ready)
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(s.logs()) from None
                time.sleep(0.2)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def executor_gone_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A stack whose only executor served one request and was then killed: the gateway and the
    renderer keep the limits it published, and new requests wait in the scheduler's queue."""
    s = Stack(tiny_model, tmp_path_factory.mktemp("gone"))
    try:
        s.add_scheduler("scheduler-0", "--max-queued-requests", "1")
        s.add_renderer()
        s.add_executor()
        s.add_gateway("gateway-0", "--api-key", KEY)
        s.wait_ready()
        client = openai.OpenAI(base_url=s.base_url() + "/v1", api_key=KEY, max_retries=0)
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        s.kill("executor-0")
        # Until the scheduler itself has seen the executor go (it says so in its log): a request
        # sent before that would be placed on the dead executor and failed over into the queue.
        deadline = time.monotonic() + 120
        while not re.search(r"executor executor-0 \(instance \w+\) is gone", s.logs("scheduler-0")):
            assert time.monotonic() < deadline, s.logs()
            time.sleep(0.1)
        yield s
    finally:
        s.stop()


def get(url: str, key: str | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def test_health_is_503_starting_without_executor(no_executor_stack: Stack) -> None:
    status, body = get(no_executor_stack.base_url() + "/health")
    assert status == 503 and body == {"status": "starting"}


def test_api_key(no_executor_stack: Stack) -> None:
    base = no_executor_stack.base_url()
    for key in (None, "wrong", KEY + "x"):
        status, body = get(base + "/v1/models", key)
        assert status == 401, (key, body)
        assert body["error"]["type"] == "authentication_error"
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert get(base + "/v1/models", KEY)[0] == 200
    # Probes and scrapers need no key.
    status, text = get(base + "/metrics")
    assert status == 200 and "voltserve:http_requests_total" in text
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    good = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="other", prompt="x", max_tokens=2)


async def test_queue_full_is_503(executor_gone_stack: Stack) -> None:
    url = executor_gone_stack.base_url() + "/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}

    async def post(session: aiohttp.ClientSession, b: dict) -> tuple[int, dict]:
        async with session.post(url, json=b, headers=headers) as r:
            return r.status, await r.json()

    async with aiohttp.ClientSession() as s:
        # No live executor and room for one waiting request: of two, exactly one is refused.
        tasks = [
            asyncio.create_task(post(s, body)),
            asyncio.create_task(post(s, dict(body, stream=True))),
        ]
        done, pending = await asyncio.wait(tasks, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, executor_gone_stack.logs()
        status, err = done.pop().result()
        assert status == 503, err
        assert "--max-queued-requests=1" in err["error"]["message"]
        # The other one waits in the queue; the client gives up (its abort empties the queue).
        await asyncio.sleep(0.5)
        assert not pending.pop().done()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # The openai client sees the same status (n=2: the second choice finds the queue full).
    client = openai.AsyncOpenAI(
        base_url=executor_gone_stack.base_url() + "/v1", api_key=KEY, max_retries=0
    )
    with pytest.raises(openai.APIStatusError) as e:
        await asyncio.wait_for(
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=2), 60
        )
    assert e.value.status_code == 503
