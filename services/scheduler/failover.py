"""Failover bookkeeping: for every admitted, unfinished request, where it runs and which output
tokens have been streamed (learned by tailing the gateway output streams). When an executor goes
away, its requests are re-sent elsewhere with those tokens as output_token_ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
from voltserve.shared.protocol import EngineRequest, RequestDelta, decode, encode


@dataclass
class Tracked:
    req: EngineRequest
    executor_id: str = ""  # "" while queued in the scheduler
    instance: str = ""
    # Output tokens known to have been streamed, by output position (contiguous prefix).
    tokens: list[int] = field(default_factory=list)
    aborted: bool = False  # an abort was forwarded; never resend it

    def to_record(self) -> bytes:
        return msgpack.packb(
            {"req": encode(self.req), "executor_id": self.executor_id, "instance": self.instance}
        )

    @classmethod
    def from_record(cls, data: bytes) -> Tracked:
        d = msgpack.unpackb(data, raw=False)
        req = decode(d["req"])
        return cls(req, d["executor_id"], d["instance"], list(req.output_token_ids))


def base_id(request_id: str) -> str:
    """'{id}.{i}' (one of n choices) -> '{id}'."""
    head, _, tail = request_id.rpartition(".")
    return head if head and tail.isdigit() else request_id


class RequestTracker:
    def __init__(self) -> None:
        self.requests: dict[str, Tracked] = {}
        self.by_base: dict[str, set[str]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def add(self, req: EngineRequest) -> Tracked:
        t = Tracked(req, tokens=list(req.output_token_ids))
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
            if offset == len(tokens):
                tokens += token_ids  # the common case: the next tokens, in order
            elif offset + len(token_ids) > len(tokens):
                tokens[offset:] = token_ids
        return finish_reason is not None

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
