"""Failover bookkeeping: for every admitted, unfinished request, where it runs and which output
tokens have been streamed (learned by tailing the gateway output streams). When an executor goes
away, its requests are re-sent elsewhere with those tokens as output_token_ids.

The crash-loop guard: a request that kills the executor running it (an input that crashes the
engine) would kill every executor it is failed over to. So each request counts the executor
deaths it was in flight for with no token streamed in between (a death after progress counts
as the first again). At CRASH_LOOP_DEATHS it is failed with a 500 instead of being placed again.
Until it streams a token after a death, a request is a suspect, and an executor runs at most one
suspect at a time: the requests that were only in the same batch as the culprit are placed
apart from it, so the next death counts against the culprit alone and they go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
from voltserve.shared.protocol import EngineRequest, RequestDelta, decode, encode

# In flight at this many executor deaths in a row (no token streamed in between): failed, not
# placed again.
CRASH_LOOP_DEATHS = 2


@dataclass
class Tracked:
    req: EngineRequest
    executor_id: str = ""  # "" while queued in the scheduler
    instance: str = ""
    # Output tokens known to have been streamed, by output position (contiguous prefix).
    tokens: list[int] = field(default_factory=list)
    aborted: bool = False  # an abort was forwarded; never resend it
    # Executor deaths in a row it was in flight for, and len(tokens) at the last one.
    deaths: int = 0
    resumed_at: int = 0

    @property
    def suspect(self) -> bool:
        """In flight at an executor death and no token streamed since: placed on an executor
        that runs no other suspect."""
        return self.deaths > 0 and len(self.tokens) <= self.resumed_at

    def to_record(self) -> bytes:
        return msgpack.packb(
            {
                "req": encode(self.req),
                "executor_id": self.executor_id,
                "instance": self.instance,
                "deaths": self.deaths,
                "resumed_at": self.resumed_at,
            }
        )

    @classmethod
    def from_record(cls, data: bytes) -> Tracked:
        d = msgpack.unpackb(data, raw=False)
        req = decode(d["req"])
        t = cls(req, d["executor_id"], d["instance"], list(req.output_token_ids))
        t.deaths, t.resumed_at = int(d.get("deaths", 0)), int(d.get("resumed_at", 0))
        return t


def base_id(request_id: str) -> str:
    """'{id}.{i}' (one of n choices) -> '{id}'."""
    head, _, tail = request_id.rpartition(".")
    return head if head and tail.isdigit() else request_id


def crash_loop_message(deaths: int) -> str:
    return (
        f"the request was in flight on {deaths} executors that died, with no output in between; "
        "it is not run again so that it cannot take down another executor (their logs say why "
        "they died)"
    )


class RequestTracker:
    def __init__(self) -> None:
        self.requests: dict[str, Tracked] = {}
        self.by_base: dict[str, set[str]] = {}
        # A suspect streamed a token since the last look: another one may be placed now.
        self.suspect_cleared = False

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def add(self, req: EngineRequest) -> Tracked:
        t = Tracked(req, tokens=list(req.output_token_ids))
        t.resumed_at = len(t.tokens)
        self.requests[req.request_id] = t
        self.by_base.setdefault(base_id(req.request_id), set()).add(req.request_id)
        return t

    def restore(self, t: Tracked) -> None:
        self.requests[t.req.request_id] = t
        self.by_base.setdefault(base_id(t.req.request_id), set()).add(t.req.request_id)

    def finish(self, request_id: str) -> Tracked | None:
        t = self.requests.pop(request_id, None)
        if t is not None:
            ids = self.by_base.get(base_id(request_id))
            if ids is not None:
                ids.discard(request_id)
                if not ids:
                    del self.by_base[base_id(request_id)]
        return t

    def match(self, request_id: str) -> list[str]:
        """Ids an abort for `request_id` means: itself, or all n choices of a base id."""
        if request_id in self.requests:
            return [request_id]
        return sorted(self.by_base.get(request_id, ()))

    def on_delta(self, d: RequestDelta) -> bool:
        """Record streamed tokens. Returns True when the delta finished the request."""
        return self.on_progress(d.request_id, d.output_offset, d.token_ids, d.finish_reason)

    def on_progress(
        self, request_id: str, offset: int, token_ids: list[int], finish_reason: str | None
    ) -> bool:
        """on_delta from the fields alone (the output tail does not build RequestDeltas)."""
        t = self.requests.get(request_id)
        if t is None:
            return False
        # Place by offset: repeats overwrite identical positions, a gap (trimmed history) stops
        # the contiguous prefix; a resend then recomputes a little more, and receivers drop the
        # repeats by output_offset.
        tokens = t.tokens
        if offset <= len(tokens):
            if t.deaths and len(tokens) <= t.resumed_at < offset + len(token_ids):
                self.suspect_cleared = True
            if offset == len(tokens):
                tokens += token_ids  # the common case: the next tokens, in order
            elif offset + len(token_ids) > len(tokens):
                tokens[offset:] = token_ids
        return finish_reason is not None

    def on_death(self, t: Tracked) -> bool:
        """The executor running t died. True when that makes CRASH_LOOP_DEATHS deaths in a row
        with no token streamed in between: fail it instead of placing it again."""
        t.deaths = 1 if len(t.tokens) > t.resumed_at else t.deaths + 1
        t.resumed_at = len(t.tokens)
        return t.deaths >= CRASH_LOOP_DEATHS

    def suspect_executors(self) -> set[str]:
        """Executors running a suspect now (each takes one at a time)."""
        return {t.executor_id for t in self.requests.values() if t.executor_id and t.suspect}

    def take_suspect_cleared(self) -> bool:
        cleared, self.suspect_cleared = self.suspect_cleared, False
        return cleared

    def load(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.requests.values():
            if t.executor_id:
                out[t.executor_id] = out.get(t.executor_id, 0) + 1
        return out

    def on_executor(self, executor_id: str, instance: str) -> list[Tracked]:
        return [
            t
            for t in self.requests.values()
            if t.executor_id == executor_id and t.instance == instance
        ]

    def resend_request(self, t: Tracked) -> EngineRequest:
        r = t.req
        return EngineRequest(
            request_id=r.request_id,
            gateway_id=r.gateway_id,
            prompt_token_ids=list(r.prompt_token_ids),
            sampling=dict(r.sampling),
            arrival_time=r.arrival_time,
            output_token_ids=list(t.tokens),
        )

    def gateways(self) -> set[str]:
        return {t.req.gateway_id for t in self.requests.values()}


# What the output tail needs of a vs:gw message: request ids, offsets, tokens and whether it
# finished. Logprobs and prompt counts are skipped, and no dataclass is built per delta.
PROGRESS = "progress"
FAILED = "failed"


def decode_progress(data: bytes) -> tuple[str, Any] | None:
    """vs:gw payload -> (PROGRESS, [(request_id, offset, token_ids, finish_reason), ...]) for a
    StepOutput, (FAILED, request_id) for a RequestError, None for anything else. ValueError when
    malformed (as protocol.decode)."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        kind = d["t"]
        if kind == "StepOutput":
            return PROGRESS, [
                (x["request_id"], x["output_offset"], x["token_ids"], x.get("finish_reason"))
                for x in d["deltas"]
            ]
        if kind == "RequestError":
            return FAILED, d["request_id"]
    except Exception as e:  # noqa: BLE001 - any decoding failure is the same error to callers
        raise ValueError(f"malformed message: {e}") from e
    return None


def max_tokens_of(req: EngineRequest) -> int | None:
    v: Any = req.sampling.get("max_tokens")
    return int(v) if v is not None else None
