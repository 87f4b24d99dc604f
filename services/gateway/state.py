"""Everything the gateway's handlers share, held by the aiohttp app (no module globals)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from voltserve.services.gateway.broker_outage import LOST_AFTER_S
from voltserve.services.gateway.dispatcher import OutputDispatcher
from voltserve.services.gateway.metrics import GatewayMetrics
from voltserve.services.renderer.render import Renderer
from voltserve.shared.appender import StreamAppender
from voltserve.shared.model_limits import PublishedLimits


@dataclass
class GatewayState:
    redis: Any
    gateway_id: str
    renderer: Renderer  # tokenizer + chat template, for /tokenize and detokenization
    served_model_names: list[str]
    model_path: str
    api_key: str | None
    max_request_bytes: int  # --max-request-bytes or its default (body_limits.py)
    metrics: GatewayMetrics
    dispatcher: OutputDispatcher
    background: set[asyncio.Task] = field(default_factory=set)
    # Appends to the render/scheduler streams, batched across requests (a burst of arrivals
    # costs a round trip, not one each). Built from `redis` when not given.
    appender: StreamAppender | None = None
    # --enable-auto-tool-choice / --tool-call-parser / --reasoning-parser (tools.ChatTooling);
    # None: no tool parsing, no reasoning split.
    tooling: Any = None
    # The executors' published limits (shared/model_limits.py), followed into renderer.limits
    # by refresh_limits. None: the renderer's limits are used as they are (tests set them).
    limits: PublishedLimits | None = None
    # --lost-request-timeout (broker_outage.LostRequestWatch).
    lost_request_timeout_s: float = LOST_AFTER_S

    def __post_init__(self) -> None:
        if self.appender is None:
            self.appender = StreamAppender(self.redis)

    async def refresh_limits(self) -> None:
        """renderer.limits <- what the executors published (at most one Redis read a second
        once known). Until an executor has published, they stay None and whatever needs them
        answers a 503 (render.LimitsUnknown)."""
        if self.limits is not None:
            self.renderer.limits = await self.limits.get()

    @property
    def max_model_len(self) -> int:
        """The context the executors enforce (render.LimitsUnknown until one published)."""
        return self.renderer.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.renderer.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def spawn(self, coro: Coroutine) -> None:
        """Fire and forget, but keep a reference so the task is not garbage-collected."""
        t = asyncio.get_running_loop().create_task(coro)
        self.background.add(t)
        t.add_done_callback(self.background.discard)
