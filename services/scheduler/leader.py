"""Leader election: one active scheduler holds a lease key (SET NX PX), renewing it; standbys
poll and take over when it expires."""

from __future__ import annotations

import asyncio
import logging

from voltserve.shared import streams

logger = logging.getLogger(__name__)

# Renew while the key holds our own token. If it expired (we were starved for a moment) and
# nobody took it, take it back: stepping down would only make us rebuild our own state.
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaderLease:
    def __init__(self, r, token: str, ttl_s: float = 3.0) -> None:
        self.r = r
        self.token = token
        self.ttl_ms = max(100, int(ttl_s * 1000))
        self.key = streams.scheduler_lease_key()
        self.lost = asyncio.Event()

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until we hold the lease (True) or `stop` is set (False)."""
        logged = False
        while not stop.is_set():
            # Our own token still there: we stepped down after an error and may go on at once.
            if await self.r.set(self.key, self.token, nx=True, px=self.ttl_ms) or (
                await self.r.get(self.key) == self.token.encode()
            ):
                self.lost.clear()
                return True
            if not logged:
                logger.warning("another scheduler is leader; standing by")
                logged = True
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.ttl_ms / 3000)
            except TimeoutError:
                pass
        return False

    async def keep(self) -> None:
        """Renew every ttl/4 until renewal fails; then set `lost` and return."""
        while True:
            await asyncio.sleep(self.ttl_ms / 4000)
            try:
                ok = await self.r.eval(_RENEW, 1, self.key, self.token, self.ttl_ms)
            except Exception:  # noqa: BLE001 - a Redis hiccup: retry until the lease runs out
                logger.exception("lease renewal failed")
                continue
            if not ok:
                logger.error("lost the scheduler lease; stepping down")
                self.lost.set()
                return

    async def release(self) -> None:
        try:
            # Bounded: with the broker away the call would wait for it (shared/broker.py).
            await asyncio.wait_for(self.r.eval(_RELEASE, 1, self.key, self.token), timeout=2)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
