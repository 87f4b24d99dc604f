"""One generation request seen from the gateway: send it to the renderer, turn the engine's token
deltas into text deltas per choice (detokenizer + stop strings), abort what is no longer wanted."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from voltserve.services.gateway.broker_outage import check_broker
from voltserve.services.gateway.detokenizer import IncrementalDetokenizer
from voltserve.services.gateway.dispatcher import Handle
from voltserve.services.gateway.errors import APIError
from voltserve.services.gateway.params import GenerationSpec
from voltserve.services.gateway.state import GatewayState
from voltserve.services.gateway.stop import StopMatcher
from voltserve.services.renderer.render import RenderFailed
from voltserve.shared import streams
from voltserve.shared.metrics import RequestTimer
from voltserve.shared.protocol import AbortRequest, RenderRequest, encode

logger = logging.getLogger(__name__)


# What a logprob of -infinity (a token a grammar forbids, among the top N) is sent as: JSON has
# no infinity, and vLLM sends the same floor.
LOGPROB_FLOOR = -9999.0


def logprob_value(value: Any) -> float:
    """A logprob from the engine as the client gets it. NaN or +infinity cannot be a logprob
    (the engine ends a request whose logits are not finite): refused, never written."""
    x = float(value)
    if math.isnan(x) or x == math.inf:
        raise APIError(500, f"internal error: the engine sent a non-finite logprob ({x})")
    return max(x, LOGPROB_FLOOR)


@dataclass
class TokenInfo:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class PromptInfo:
    """The prompt as the engine saw it, with its logprobs (prompt_logprobs / echo)."""

    token_ids: list[int]
    # One per prompt token; the first is None (no context). logprob None: not computed.
    logprobs: list[TokenInfo | None]
    ranks: list[int | None]


@dataclass
class ChoiceUpdate:
    index: int
    text: str
    logprobs: list[TokenInfo] | None  # one per new token, when logprobs were asked for
    finish_reason: str | None
    prompt: PromptInfo | None = None  # on the first update, when prompt logprobs were asked


@dataclass
class ChoiceState:
    detok: IncrementalDetokenizer
    stop: StopMatcher
    timer: RequestTimer
    num_tokens: int = 0
    finished: bool = False
    # Counted in vllm:request_success (once, after the client took the final update).
    counted: bool = False
    executor_id: str = ""


@dataclass
class Generation:
    gw: GatewayState
    spec: GenerationSpec
    prefix: str  # "chatcmpl" | "cmpl"
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    handle: Handle | None = None
    choices: list[ChoiceState] = field(default_factory=list)
    error_status: int | None = None
    started: bool = False

    def __post_init__(self) -> None:
        # No "." in the id: engine requests are "{request_id}.{i}".
        self.request_id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.choices = [
            ChoiceState(
                IncrementalDetokenizer(self.gw.tokenizer, self.spec.skip_special_tokens),
                StopMatcher(self.spec.stop),
                RequestTimer(self.gw.model_name),
            )
            for _ in range(self.spec.n)
        ]

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.completion_tokens,
        }

    async def start(self) -> None:
        s = self.spec
        await self._check_prompt()
        check_broker(self.gw.redis)  # away: a 503 now rather than a wait
        self.handle = self.gw.dispatcher.register(self.request_id, s.n)
        msg = RenderRequest(
            request_id=self.request_id,
            gateway_id=self.gw.gateway_id,
            kind=s.kind,
            messages=s.messages,
            prompt=s.prompt,
            sampling=s.params.to_dict(),
            n=s.n,
            add_generation_prompt=s.add_generation_prompt,
            chat_template_kwargs=s.chat_template_kwargs,
            arrival_time=time.time(),
            max_tokens_explicit=s.max_tokens_explicit,
        )
        try:
            payload = encode(msg)
        except (OverflowError, ValueError) as e:
            # msgpack refused a value the parameter checks let through (an integer past 64 bits
            # deep in messages or chat_template_kwargs): the caller's 400, and nothing was sent.
            raise APIError(400, f"the request holds a value that cannot be sent on: {e}") from e
        large = len(payload) > streams.LARGE_RENDER_BYTES or s.params.structured is not None
        stream = streams.render_large_stream() if large else streams.render_stream()
        await self.gw.appender.xadd_encoded(stream, payload)
        self.started = True

    async def _check_prompt(self) -> None:
        """A prompt that certainly cannot fit is refused here, before it travels: a completion
        prompt by its length, and a prompt or conversation far longer than the context needs
        is counted in pieces in a worker thread (the renderer checks every prompt again)."""
        s, r = self.spec, self.gw.renderer
        try:
            if s.prompt is not None:
                r.check_prompt_size(s.prompt)
                if isinstance(s.prompt, str) and r.worth_counting_early(len(s.prompt)):
                    await asyncio.to_thread(r.check_text_length, s.prompt, "prompt")
            elif s.messages is not None and r.worth_counting_early(_content_chars(s.messages)):
                await asyncio.to_thread(
                    r.check_chat_length,
                    s.messages,
                    s.add_generation_prompt,
                    s.chat_template_kwargs,
                )
        except RenderFailed as e:
            raise APIError(e.status, e.message, param=e.param) from e

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Yield text deltas until every choice finished. Raises APIError on a request error.

        Deltas that queued up while the consumer was busy (writing to a slow client, or a busy
        gateway) go out as one update per choice: one SSE chunk carrying all their text instead
        of one chunk each. With logprobs every delta stays its own update (their text offsets
        are per update)."""
        assert self.handle is not None
        queue = self.handle.queue
        merge = self.spec.params.logprobs is None
        while not all(c.finished for c in self.choices):
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            pending: dict[int, ChoiceUpdate] = {}
            out: list[ChoiceUpdate] = []
            error = None
            for ev in events:
                if ev.error is not None:
                    error = ev.error
                    break
                u = self._apply(ev)
                if u is None:
                    continue
                prev = pending.get(u.index) if merge else None
                if prev is None:
                    pending[u.index] = u
                    out.append(u)
                else:
                    prev.text += u.text
                    prev.finish_reason = u.finish_reason
                    prev.prompt = prev.prompt or u.prompt
            for u in out:
                yield u
                if u.finish_reason is not None:
                    # Counted only once the consumer came back for more, i.e. the final update
                    # reached the client; a client that dropped first is counted as "abort" by
                    # close().
                    self._count(self.choices[u.index], u.finish_reason)
            if error is not None:
                self.error_status = error.status
                raise APIError(error.status, error.message, param=error.param, type=error.type)

    def _apply(self, ev: Any) -> ChoiceUpdate | None:
        """One engine delta through the detokenizer and the stop strings of its choice."""
        assert self.handle is not None
        st, d = self.choices[ev.index], ev.delta
        if st.finished or d is None:
            return None
        st.executor_id = ev.executor_id or st.executor_id
        if d.num_prompt_tokens and not self.num_prompt_tokens:
            self.num_prompt_tokens = d.num_prompt_tokens
            self.num_cached_tokens = d.num_cached_tokens
        st.timer.num_prompt_tokens = self.num_prompt_tokens
        st.timer.on_tokens(len(d.token_ids))
        finish = d.finish_reason
        ids = d.token_ids
        if self.spec.discard_output:
            ids = []  # max_tokens 0: the step ran for the prompt's logprobs only
        elif finish == "stop" and ids and not self.spec.skip_special_tokens:
            # The stop token itself is not part of the text (it would show once special
            # tokens are kept, as they are for tool parsers that need them).
            if (
                ids[-1] in self.gw.renderer.eos_token_ids
                or ids[-1] in self.spec.params.stop_token_ids
            ):
                ids = ids[:-1]
        n_used = len(d.token_ids)
        if len(ids) > 1 and st.stop.stops:
            # Several tokens in one delta (speculative decoding): feed them one at a time, so
            # a stop string ends the output, its token count and logprobs at the token that
            # completes it, exactly as one token per delta would.
            text = ""
            for j, t in enumerate(ids):
                text += st.stop.feed(st.detok.add([t]))
                if st.stop.stopped:
                    n_used = j + 1
                    break
            if not st.stop.stopped and finish is not None:
                text += st.stop.feed(st.detok.flush())
        else:
            text = st.detok.add(ids)
            if finish is not None:
                text += st.detok.flush()
            text = st.stop.feed(text)
        st.num_tokens += len(ids) if self.spec.discard_output else n_used
        if st.stop.stopped:
            if finish is None:
                self.abort([self.handle.engine_id(ev.index)], "stop string")
            finish = "stop"
        elif finish is not None:
            text += st.stop.flush()
        if finish is not None:
            st.finished = True
        prompt = _prompt_info(d) if d.prompt_logprobs is not None else None
        lp = None if self.spec.discard_output else self._logprobs(d)
        if lp is not None and n_used < len(lp):
            lp = lp[:n_used]
        return ChoiceUpdate(ev.index, text, lp, finish, prompt)

    def _logprobs(self, d: Any) -> list[TokenInfo] | None:
        if self.spec.params.logprobs is None or not d.logprobs:
            return None
        out = []
        for tok, lp in zip(d.token_ids, d.logprobs):
            top = [(int(t), logprob_value(v)) for t, v in (lp.get("top") or [])]
            out.append(TokenInfo(tok, logprob_value(lp["logprob"]), top))
        return out

    def _count(self, st: ChoiceState, finish: str) -> None:
        if not st.counted:
            st.counted = True
            self.gw.metrics.requests.observe_finished(st.timer, finish, st.executor_id)

    def abort(self, engine_ids: list[str], reason: str) -> None:
        if engine_ids:
            msg = AbortRequest(request_ids=engine_ids, reason=reason)
            self.gw.spawn(self.gw.appender.xadd(streams.sched_stream(), msg))

    def close(self, reason: str = "client gone") -> None:
        """Always called when the HTTP handler ends: abort whatever still runs, forget the id."""
        if self.handle is None:
            return
        unfinished = [
            self.handle.engine_id(i) for i, c in enumerate(self.choices) if not c.finished
        ]
        self.abort(unfinished, reason)
        self.gw.dispatcher.unregister(self.request_id)
        if self.error_status is not None:
            self.gw.metrics.requests.observe_error(self.gw.model_name, self.error_status)
        elif self.started:
            # Every choice the client did not see to its end was aborted (a disconnect, a
            # cancelled handler): vLLM counts those as finished_reason="abort".
            for st in self.choices:
                self._count(st, "abort")
        self.handle = None


def _content_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of a conversation's text content (what its template writes at least
    once in most templates: an estimate, not a bound)."""
    n = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p["text"]) for p in content if isinstance(p.get("text"), str))
    return n


def _prompt_info(d: Any) -> PromptInfo:
    ids = list(d.prompt_token_ids or [])
    infos: list[TokenInfo | None] = []
    ranks: list[int | None] = []
    for tok, e in zip(ids, d.prompt_logprobs):
        if e is None:
            infos.append(None)
            ranks.append(None)
            continue
        top = [(int(t), logprob_value(v)) for t, v in (e.get("top") or [])]
        infos.append(TokenInfo(tok, logprob_value(e["logprob"]), top))
        ranks.append(int(e["rank"]))
    return PromptInfo(ids, infos, ranks)
