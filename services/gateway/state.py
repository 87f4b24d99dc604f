"""Everything the gateway's handlers share, held by the aiohttp app (no module globals)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from voltserve.services.gateway.dispatcher import OutputDispatcher
from voltserve.services.gateway.metrics import GatewayMetrics
from voltserve.services.renderer.render import Renderer
from voltserve.shared.appender import StreamAppender


@dataclass
class GatewayState:
    redis: Any
    gateway_id: str
    renderer: Renderer  # tokenizer + chat template, for /tokenize and detokenization
    served_model_names: list[str]
    model_path: str
    max_model_len: int
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

    def __post_init__(self) -> None:
        if self.appender is None:
            self.appender = StreamAppender(self.redis)

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
