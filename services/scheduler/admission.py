"""Bounded admission queue: requests wait here until an executor has room for them."""

from __future__ import annotations

from collections import deque

from voltserve.shared.protocol import EngineRequest


class AdmissionQueue:
    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self._q: deque[EngineRequest] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def full(self) -> bool:
        return len(self._q) >= self.max_queued

    def push(self, req: EngineRequest) -> None:
        self._q.append(req)

    def push_front(self, req: EngineRequest) -> None:
        """Failed-over requests jump the queue and ignore the bound: they were admitted once."""
        self._q.appendleft(req)

    def peek(self) -> EngineRequest | None:
        return self._q[0] if self._q else None

    def pop(self) -> EngineRequest:
        return self._q.popleft()

    def remove(self, request_id: str) -> EngineRequest | None:
        for req in self._q:
            if req.request_id == request_id:
                self._q.remove(req)
                return req
        return None

    def ids(self) -> list[str]:
        return [r.request_id for r in self._q]
