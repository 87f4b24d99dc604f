"""The limits an executor enforces, decided once by the executor and published in its status
hash; the gateway (/v1/models, the default max_tokens, early length checks) and the renderer
(fit_context, eos ids, token id checks) read them from there instead of deriving their own.

- max_model_len: the context after every cap (the model's length or --max-model-len, its sliding
  window, what the KV cache holds).
- eos_token_ids: the ids that end a request (generation_config.json, else config.json, else the
  GGUF metadata: services/executor/loader.py:read_eos_token_ids).
- vocab_size: token ids a request may name are in [0, vocab_size).

Several executors: a request must fit whichever one it is placed on, so the published limits are
the smallest context and vocabulary among the live executors (executors of one deployment serve
one model, so their eos ids agree; their union is taken).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from voltserve.shared import broker, streams

logger = logging.getLogger(__name__)

# The status hash fields (written every heartbeat with the rest of the status).
FIELDS = ("max_model_len", "eos_token_ids", "vocab_size")

# How long a reader trusts what it read before asking Redis again.
REFRESH_S = 1.0


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def to_status(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "eos_token_ids": ",".join(str(i) for i in self.eos_token_ids),
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_status(cls, h: Mapping[Any, Any]) -> ModelLimits | None:
        """The limits in a status hash; None when it holds none (an executor still starting, or
        one older than this field set)."""
        d = {_s(k): _s(v) for k, v in h.items()}
        try:
            eos = d["eos_token_ids"]
            return cls(
                max_model_len=int(d["max_model_len"]),
                eos_token_ids=tuple(int(x) for x in eos.split(",") if x),
                vocab_size=int(d["vocab_size"]),
            )
        except (KeyError, ValueError):
            return None


def combine(limits: list[ModelLimits]) -> ModelLimits | None:
    """What every one of these executors accepts (see the module's docstring); None for none."""
    if not limits:
        return None
    eos: dict[int, None] = {}
    for lim in limits:
        eos.update(dict.fromkeys(lim.eos_token_ids))
    return ModelLimits(
        max_model_len=min(lim.max_model_len for lim in limits),
        eos_token_ids=tuple(eos),
        vocab_size=min(lim.vocab_size for lim in limits),
    )


async def read_published(r: Any) -> ModelLimits | None:
    """The combined limits of the live executors (redis.asyncio client); None while none has
    published."""
    ids = sorted(_s(x) for x in await r.smembers(streams.executors_key()))
    if not ids:
        return None
    async with r.pipeline(transaction=False) as p:
        for eid in ids:
            p.exists(streams.executor_alive_key(eid))
            p.hmget(streams.executor_status_key(eid), list(FIELDS))
        res = await p.execute()
    found = []
    for k in range(len(ids)):
        alive, values = res[2 * k], res[2 * k + 1]
        if alive and values and all(v is not None for v in values):
            lim = ModelLimits.from_status(dict(zip(FIELDS, values, strict=True)))
            if lim is not None:
                found.append(lim)
    return combine(found)


class PublishedLimits:
    """A reader's view of the published limits, asked of Redis at most every REFRESH_S. The last
    limits seen are kept while no executor is alive (a restart or a failover in progress) and
    while the broker is away: a model's limits do not change because its executors or the broker
    come and go."""

    def __init__(self, redis: Any, refresh_s: float = REFRESH_S) -> None:
        self.redis = redis
        self.refresh_s = refresh_s
        self.current: ModelLimits | None = None
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()

    async def get(self) -> ModelLimits | None:
        """The current limits (None until an executor has published: then every call asks
        Redis, so the first request after the executor's first heartbeat sees them)."""
        if self.current is not None and time.monotonic() - self._read_at < self.refresh_s:
            return self.current
        async with self._lock:
            if self.current is None or time.monotonic() - self._read_at >= self.refresh_s:
                try:
                    # Never waits out a broker outage: the limits known are still the model's,
                    # and a request that needs the broker gets its own 503 (or waits) later.
                    with broker.fail_fast():
                        new = await read_published(self.redis)
                except broker.BrokerUnavailable:
                    if self.current is None:
                        raise
                    return self.current
                self._read_at = time.monotonic()
                if new is not None and new != self.current:
                    if self.current is not None:
                        logger.info("executor limits changed: %s -> %s", self.current, new)
                    self.current = new
        return self.current

    async def wait(self, stop: asyncio.Event | None = None, poll_s: float = 0.2) -> ModelLimits:
        """Until an executor has published its limits (or `stop` is set: then RuntimeError)."""
        while True:
            try:
                lim = await self.get()
            except broker.BrokerUnavailable:
                lim = None  # asked again once the broker is back
            if lim is not None:
                return lim
            if stop is not None and stop.is_set():
                raise RuntimeError("stopped before any executor published its limits")
            await asyncio.sleep(poll_s)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
