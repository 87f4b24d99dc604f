"""The translation layer the Responses API and the Messages API share.

A protocol's request becomes an internal chat-completions request (`ChatCall`), which goes
through exactly what /v1/chat/completions runs: its parameter checks (params.parse_chat), its
tool and reasoning plan (tools.plan_chat), structured outputs and one Generation. The chat
output comes back as an ordered list of `Block`s (reasoning, text, tool calls): whole, read by
the chat route's own `ChatOutput.message`, or as stream events (`Opened`, `Appended`, `Closed`)
made from the chat route's stream deltas (`ChatOutput.feed`). Each protocol only writes those
blocks in its own shape (responses_output.py, messages_output.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from voltserve.services.gateway import sse
from voltserve.services.gateway.errors import APIError
from voltserve.services.gateway.generate import ChoiceUpdate, Generation
from voltserve.services.gateway.params import GenerationSpec, parse_chat
from voltserve.services.gateway.routes import CLIENT_GONE
from voltserve.services.gateway.state import GatewayState
from voltserve.services.gateway.tools import ChatOutput, ChatPlan, ChatTooling, plan_chat

logger = logging.getLogger(__name__)

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"


@dataclass
class ChatCall:
    """A protocol's request as a chat-completions body, and the protocol's names of the chat
    fields it was built from, so that an error names the field the client sent."""

    body: dict[str, Any]
    names: dict[str, str] = field(default_factory=dict)


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """The error with a chat field's name (its param, and its message's first word) replaced by
    the protocol's name for it."""
    if e.param is None or e.param not in names:
        return e
    name = names[e.param]
    message = e.message
    if message.startswith(e.param) and message[len(e.param) : len(e.param) + 1] in (" ", ".", ""):
        message = name + message[len(e.param) :]
    return APIError(e.status, message, param=name, type=e.type, code=e.code)


def prepare(gw: GatewayState, call: ChatCall) -> tuple[GenerationSpec, ChatPlan]:
    """The chat route's request checks and plan, run on the translated body."""
    try:
        spec = parse_chat(call.body, gw.renderer.vocab_size, gw.max_model_len)
        plan = plan_chat(call.body, spec, gw.tooling or ChatTooling())
    except APIError as e:
        raise renamed(e, call.names) from e
    return spec, plan


# ---- the output as blocks ------------------------------------------------------------------


@dataclass
class Block:
    kind: str  # REASONING | TEXT | TOOL_CALL
    text: str = ""  # the text; for a tool call, its arguments (JSON text)
    name: str = ""  # tool call: the function
    call_id: str = ""  # tool call: its id


def blocks_of(message: dict[str, Any]) -> list[Block]:
    """A chat message (ChatOutput.message) as blocks, in the order a stream would send them."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append(Block(REASONING, message["reasoning_content"]))
    if message.get("content"):
        blocks.append(Block(TEXT, message["content"]))
    for c in message.get("tool_calls") or []:
        f = c["function"]
        blocks.append(Block(TOOL_CALL, f["arguments"], f["name"], c["id"]))
    return blocks


@dataclass
class Opened:
    index: int
    block: Block  # as it starts: no text yet


@dataclass
class Appended:
    index: int
    block: Block  # with the text so far
    text: str  # what was added


@dataclass
class Closed:
    index: int
    block: Block  # whole
    cut: bool = False  # the output ended inside this block, at its token limit


StreamEvent = Opened | Appended | Closed


class BlockStream:
    """Chat stream deltas -> block events. One block is open at a time; a block of another kind
    (or a new tool call) closes it. Within one delta, the arguments of a call already open come
    before new content and new calls: that is their order in the model's text."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.open: int | None = None
        self.calls: dict[int, int] = {}  # the chat delta's tool call index -> block index

    def feed(self, delta: dict[str, Any]) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if delta.get("reasoning_content"):
            out += self._text(REASONING, delta["reasoning_content"])
        new_calls = []
        for tc in delta.get("tool_calls") or []:
            k = self.calls.get(tc["index"])
            if k is None:
                new_calls.append(tc)
            elif tc["function"].get("arguments"):
                out.append(self._append(k, tc["function"]["arguments"]))
        if delta.get("content"):
            out += self._text(TEXT, delta["content"])
        for tc in new_calls:
            out += self.close()
            f = tc["function"]
            self.blocks.append(Block(TOOL_CALL, "", f["name"], tc["id"]))
            self.open = self.calls[tc["index"]] = len(self.blocks) - 1
            out.append(Opened(self.open, Block(TOOL_CALL, "", f["name"], tc["id"])))
            if f.get("arguments"):
                out.append(self._append(self.open, f["arguments"]))
        return out

    def close(self, cut: bool = False) -> list[StreamEvent]:
        if self.open is None:
            return []
        k, self.open = self.open, None
        return [Closed(k, self.blocks[k], cut)]

    def _text(self, kind: str, text: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self.open is None or self.blocks[self.open].kind != kind:
            out += self.close()
            self.blocks.append(Block(kind))
            self.open = len(self.blocks) - 1
            out.append(Opened(self.open, Block(kind)))
        out.append(self._append(self.open, text))
        return out

    def _append(self, k: int, text: str) -> Appended:
        self.blocks[k].text += text
        return Appended(k, self.blocks[k], text)


# ---- running one request -------------------------------------------------------------------


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Ending:
    finish_reason: str | None  # the engine's: "stop" | "length" | "abort"
    stop_sequence: str | None  # the stop string that ended the output
    num_tool_calls: int
    usage: Usage


class StreamWriter(Protocol):
    """A protocol's stream: the bytes of its events for each step of the output."""

    def start(self, usage: Usage) -> bytes: ...
    def event(self, ev: StreamEvent) -> bytes: ...
    def end(self, blocks: list[Block], ending: Ending) -> bytes: ...
    def error(self, e: APIError) -> bytes: ...


def _usage(gen: Generation) -> Usage:
    u = gen.usage()
    return Usage(u["prompt_tokens"], u["completion_tokens"], gen.num_cached_tokens)


class Run:
    """One translated request through a Generation, whole or streamed."""

    def __init__(
        self, gw: GatewayState, spec: GenerationSpec, plan: ChatPlan, call: ChatCall, prefix: str
    ) -> None:
        assert spec.n == 1  # neither protocol has choices
        self.gen = Generation(gw, spec, prefix)
        self.plan = plan
        self.names = call.names

    @property
    def id_hex(self) -> str:
        """The hex part of the generation's id, for the protocol's own ids (logs match)."""
        return self.gen.request_id.split("-", 1)[1]

    def _ending(self, finish: str | None, out: ChatOutput) -> Ending:
        stop = self.gen.choices[0].stop
        matched = stop.matched if stop.stopped else None
        return Ending(finish, matched, out.num_tool_calls, _usage(self.gen))

    async def whole(self) -> tuple[list[Block], Ending]:
        texts: list[str] = []
        finish = None
        try:
            await self.gen.start()
            async for u in self.gen.updates():
                texts.append(u.text)
                finish = u.finish_reason or finish
        except APIError as e:
            raise renamed(e, self.names) from e
        finally:
            self.gen.close()
        out = self.plan.output()
        blocks = blocks_of(out.message("".join(texts)))
        return blocks, self._ending(finish, out)

    async def stream(
        self, request: web.Request, make_writer: Callable[[Run], StreamWriter]
    ) -> web.StreamResponse:
        try:
            try:
                await self.gen.start()
                updates = self.gen.updates()
                # The first update before the answer: an error (queue full, prompt too long)
                # still gets its HTTP status instead of a 200 stream.
                first = await anext(updates)
            except APIError as e:
                raise renamed(e, self.names) from e
            resp = await sse.open_stream(request)
            try:
                await self._write(resp, make_writer(self), first, updates)
            except ConnectionError as e:
                logger.info(
                    "client left mid-stream (%s): %s", self.gen.request_id, type(e).__name__
                )
                request[CLIENT_GONE] = True
            return resp
        finally:
            self.gen.close()

    async def _write(
        self,
        resp: web.StreamResponse,
        writer: StreamWriter,
        first: ChoiceUpdate,
        updates: AsyncIterator[ChoiceUpdate],
    ) -> None:
        await resp.write(writer.start(_usage(self.gen)))
        out = self.plan.output()
        blocks = BlockStream()
        finish = None

        async def send(u: ChoiceUpdate) -> None:
            nonlocal finish
            final = u.finish_reason is not None
            finish = u.finish_reason or finish
            for ev in blocks.feed(out.feed(u.text, final)):
                await resp.write(writer.event(ev))

        try:
            await send(first)
            async for u in updates:
                await send(u)
            for ev in blocks.close(cut=finish == "length"):
                await resp.write(writer.event(ev))
            await resp.write(writer.end(blocks.blocks, self._ending(finish, out)))
        except APIError as e:
            # The headers are gone: the protocol's in-band error event.
            await resp.write(writer.error(renamed(e, self.names)))
        await resp.write_eof()
