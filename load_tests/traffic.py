"""Mixed OpenAI traffic for the soak and fault runs, and the checks made afterwards.

Every request ends in exactly one bucket:
  completed     200 and a finish_reason (stream: also `data: [DONE]`)
  aborted       the client disconnected on purpose (counted, not a failure)
  failed_clear  an HTTP error with an OpenAI error body (e.g. 503 overloaded): the client knew
  lost          anything else: timeout, connection dropped, a stream without its end. Must be 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

WORDS = (
    "the a voltserve volta kernel token stream cache block river mountain seven blue quick "
    "lazy fox jumps over dog server request batch prefix hello world model output"
).split()
STOP_STRINGS = ["e", " the", "a", "o ", "\n"]


@dataclass
class Outcome:
    kind: str  # completed | aborted | failed_clear | lost
    detail: str = ""
    finish_reason: str | None = None
    latency_s: float = 0.0


@dataclass
class TrafficStats:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    lost_details: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.outcomes[o.kind] += 1
        if o.finish_reason:
            self.finish_reasons[o.finish_reason] += 1
        if o.kind == "failed_clear":
            self.errors[o.detail] += 1
        if o.kind == "lost" and len(self.lost_details) < 50:
            self.lost_details.append(o.detail)
        if o.kind == "completed":
            self.latencies.append(o.latency_s)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "requests_sent": self.sent,
            "completed": self.outcomes["completed"],
            "aborted_by_client": self.outcomes["aborted"],
            "failed_with_clear_error": self.outcomes["failed_clear"],
            "lost": self.outcomes["lost"],
            "finish_reasons": dict(self.finish_reasons),
            "errors": dict(self.errors),
            "lost_examples": self.lost_details,
            "latency_s": {
                "p50": statistics.median(lat) if lat else None,
                "p99": lat[int(0.99 * (len(lat) - 1))] if lat else None,
                "max": lat[-1] if lat else None,
            },
        }


def random_request(rng: random.Random, model: str) -> tuple[str, dict[str, Any], float | None]:
    """(path, body, abort_after_s or None)."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 120))]
    stream = rng.random() < 0.5
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(1, 64),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "stream": stream,
    }
    if rng.random() < 0.5:
        body["seed"] = rng.randint(0, 2**31 - 1)
    if rng.random() < 0.2:
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": " ".join(words)}]
    else:
        path = "/v1/completions"
        body["prompt"] = " ".join(words)
    abort_after = rng.uniform(0.0, 0.5) if stream and rng.random() < 0.15 else None
    return path, body, abort_after


async def send(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any],
    abort_after: float | None,
    timeout_s: float,
) -> Outcome:
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + path, json=body) as resp:
                if resp.status != 200:
                    return await _error_outcome(resp)
                if body["stream"]:
                    return await _read_stream(resp, abort_after, t0)
                data = await resp.json()
                reason = data["choices"][0].get("finish_reason")
                if reason not in ("stop", "length"):
                    return Outcome("lost", f"non-stream finish_reason={reason!r}")
                return Outcome("completed", finish_reason=reason, latency_s=time.monotonic() - t0)
    except TimeoutError:
        return Outcome("lost", f"timeout after {timeout_s} s ({path}, stream={body['stream']})")
    except (aiohttp.ClientError, ValueError, KeyError) as e:
        return Outcome("lost", f"{type(e).__name__}: {e}")


async def _error_outcome(resp: aiohttp.ClientResponse) -> Outcome:
    try:
        err = (await resp.json())["error"]
        return Outcome("failed_clear", f"{resp.status} {err.get('type')}")
    except (aiohttp.ContentTypeError, ValueError, KeyError, TypeError):
        return Outcome("lost", f"HTTP {resp.status} without an OpenAI error body")


async def _read_stream(
    resp: aiohttp.ClientResponse, abort_after: float | None, t0: float
) -> Outcome:
    reason = None
    done = False
    async for raw in resp.content:
        if abort_after is not None and time.monotonic() - t0 >= abort_after:
            resp.close()  # the client goes away mid-stream
            return Outcome("aborted")
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            return Outcome("failed_clear", f"stream error {chunk['error'].get('type')}")
        for c in chunk.get("choices", []):
            reason = c.get("finish_reason") or reason
    if abort_after is not None and not done:
        return Outcome("aborted")
    if not done or reason not in ("stop", "length"):
        return Outcome("lost", f"stream ended: done={done} finish_reason={reason!r}")
    return Outcome("completed", finish_reason=reason, latency_s=time.monotonic() - t0)


async def run_traffic(
    url: str,
    model: str,
    duration_s: float,
    concurrency: int,
    seed: int,
    max_requests: int,
    timeout_s: float = 120.0,
) -> TrafficStats:
    """`concurrency` workers send requests back to back until `duration_s` or `max_requests`."""
    stats = TrafficStats()
    deadline = time.monotonic() + duration_s
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=concurrency * 2)

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline and stats.sent < max_requests:
            stats.sent += 1
            path, body, abort_after = random_request(rng, model)
            stats.add(await send(session, url, path, body, abort_after, timeout_s))

    async with aiohttp.ClientSession(connector=conn) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return stats


def rss_flat(samples: list[tuple[float, dict[str, int]]], window_s: float = 60.0) -> dict:
    """Mean RSS of each service over the first and the last `window_s`; flat when the last is at
    most 15% + 32 MiB above the first (allocator warm-up and caches stay within that)."""
    if not samples:
        return {"flat": False, "reason": "no samples"}
    t_first, t_last = samples[0][0], samples[-1][0]
    out: dict[str, Any] = {"services": {}, "flat": True}
    names = set().union(*(s for _, s in samples))
    for name in sorted(names):
        first = [s[name] for t, s in samples if t - t_first <= window_s and name in s]
        last = [s[name] for t, s in samples if t_last - t <= window_s and name in s]
        if not first or not last:
            continue
        a, b = statistics.mean(first), statistics.mean(last)
        flat = b <= a * 1.15 + 32 * 2**20
        out["services"][name] = {
            "first_minute_mib": round(a / 2**20, 1),
            "last_minute_mib": round(b / 2**20, 1),
            "flat": flat,
        }
        out["flat"] = out["flat"] and flat
    return out


def kv_all_free(statuses: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Every live executor idle with every KV block free."""
    per: dict[str, Any] = {}
    ok = True
    for eid, h in statuses.items():
        if h.get("alive") != "1":
            continue
        free, total = int(h.get("num_free_blocks", -1)), int(h.get("num_total_blocks", -2))
        running, waiting = int(h.get("num_running", -1)), int(h.get("num_waiting", -1))
        good = free == total and running == 0 and waiting == 0
        per[eid] = {
            "free_blocks": free,
            "total_blocks": total,
            "running": running,
            "waiting": waiting,
            "ok": good,
        }
        ok = ok and good
    return {"ok": ok and bool(per), "executors": per}
