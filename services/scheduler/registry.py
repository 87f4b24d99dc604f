"""Executor registry built from heartbeats: alive keys with a TTL plus status hashes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from voltserve.shared import streams

logger = logging.getLogger(__name__)


@dataclass
class ExecutorInfo:
    executor_id: str
    instance: str
    status: dict[str, str] = field(default_factory=dict)

    def num(self, name: str, default: float = 0.0) -> float:
        try:
            return float(self.status.get(name, default))
        except ValueError:
            return default

    @property
    def max_num_seqs(self) -> int:
        return int(self.num("max_num_seqs", 256))

    @property
    def kv_cache_usage(self) -> float:
        return self.num("kv_cache_usage", 0.0)


class ExecutorRegistry:
    def __init__(self, r) -> None:
        self.r = r
        self.alive: dict[str, ExecutorInfo] = {}

    async def refresh(self) -> tuple[list[ExecutorInfo], list[ExecutorInfo]]:
        """Re-read heartbeats. Returns (appeared, gone): `gone` holds executors whose heartbeat
        expired or whose process was replaced (a new instance under the same id)."""
        ids = sorted(m.decode() for m in await self.r.smembers(streams.executors_key()))
        if not ids:
            seen: dict[str, ExecutorInfo] = {}
        else:
            async with self.r.pipeline(transaction=False) as p:
                for i in ids:
                    p.exists(streams.executor_alive_key(i))
                    p.hgetall(streams.executor_status_key(i))
                res = await p.execute()
            seen = {}
            for k, i in enumerate(ids):
                alive, raw = res[2 * k], res[2 * k + 1]
                if not alive or not raw:
                    continue
                status = {a.decode(): b.decode() for a, b in raw.items()}
                seen[i] = ExecutorInfo(i, status.get("instance", ""), status)
        appeared, gone = [], []
        for i, old in self.alive.items():
            new = seen.get(i)
            if new is None or new.instance != old.instance:
                gone.append(old)
        for i, new in seen.items():
            old = self.alive.get(i)
            if old is None or new.instance != old.instance:
                appeared.append(new)
        self.alive = seen
        for e in gone:
            logger.warning("executor %s (instance %s) is gone", e.executor_id, e.instance)
        for e in appeared:
            logger.info("executor %s (instance %s) joined", e.executor_id, e.instance)
        return appeared, gone
