"""POST /v1/completions and /v1/chat/completions, streaming and not."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from voltserve.services.gateway import sse
from voltserve.services.gateway.detokenizer import token_text
from voltserve.services.gateway.errors import APIError, bad_request
from voltserve.services.gateway.generate import ChoiceUpdate, Generation, TokenInfo
from voltserve.services.gateway.params import GenerationSpec, parse_chat, parse_completion
from voltserve.services.gateway.state import GatewayState

logger = logging.getLogger(__name__)

# Set on the aiohttp request when the client disconnected while its stream was written.
CLIENT_GONE = "voltserve_client_gone"


async def read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()  # over the app's client_max_size: 413 from aiohttp
    try:
        # ValueError covers JSONDecodeError, bad UTF-8 and integers past Python's digit limit.
        body = json.loads(raw)
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    # JSON may escape half of a surrogate pair ("\ud800"); no tokenizer or encoder takes that.
    # Only a body holding such an escape needs the walk.
    if b"\\ud" in raw.lower() and _has_lone_surrogate(body):
        raise bad_request("the request body holds a lone UTF-16 surrogate (invalid Unicode)")
    return body


def _has_lone_surrogate(x: Any) -> bool:
    if isinstance(x, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in x)
    if isinstance(x, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in x.items())
    if isinstance(x, list):
        return any(_has_lone_surrogate(v) for v in x)
    return False


def check_model(gw: GatewayState, body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        return gw.model_name
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {type(model).__name__}", "model")
    if model not in gw.served_model_names and model != gw.model_path:
        raise APIError(
            404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )
    return model


# ---- logprobs in the two OpenAI shapes ---------------------------------------------------------


def chat_logprobs(gw: GatewayState, infos: list[TokenInfo]) -> dict[str, Any]:
    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = token_text(gw.tokenizer, tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for t in infos:
        e = entry(t.token_id, t.logprob)
        e["top_logprobs"] = [entry(tok, lp) for tok, lp in t.top]
        content.append(e)
    return {"content": content}


def completion_logprobs(gw: GatewayState, infos: list[TokenInfo], offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for t in infos:
        text = token_text(gw.tokenizer, t.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [t.logprob for t in infos],
        "top_logprobs": [{token_text(gw.tokenizer, tok): lp for tok, lp in t.top} for t in infos],
        "text_offset": offsets,
    }


# ---- the two endpoints ---------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw: GatewayState = request.app["gw"]
    body = await read_json(request)
    model = check_model(gw, body)
    spec = parse_chat(body, gw.renderer.vocab_size, gw.max_model_len)
    return await _serve(request, gw, spec, model, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    gw: GatewayState = request.app["gw"]
    body = await read_json(request)
    model = check_model(gw, body)
    spec = parse_completion(body, gw.renderer.vocab_size)
    return await _serve(request, gw, spec, model, chat=False)


async def _serve(
    request: web.Request, gw: GatewayState, spec: GenerationSpec, model: str, chat: bool
) -> web.StreamResponse:
    gen = Generation(gw, spec, "chatcmpl" if chat else "cmpl")
    try:
        await gen.start()
        if spec.stream:
            return await _stream(request, gw, gen, model, chat)
        return await _complete(gw, gen, model, chat)
    finally:
        gen.close()


async def _complete(gw: GatewayState, gen: Generation, model: str, chat: bool) -> web.Response:
    n = gen.spec.n
    texts = [[] for _ in range(n)]
    infos: list[list[TokenInfo]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    async for u in gen.updates():
        texts[u.index].append(u.text)
        if u.logprobs:
            infos[u.index].extend(u.logprobs)
        if u.finish_reason:
            finish[u.index] = u.finish_reason
    want_lp = gen.spec.params.logprobs is not None
    choices = []
    for i in range(n):
        text = "".join(texts[i])
        if chat:
            choice = {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": chat_logprobs(gw, infos[i]) if want_lp else None,
                "finish_reason": finish[i],
            }
        else:
            choice = {
                "index": i,
                "text": text,
                "logprobs": completion_logprobs(gw, infos[i], 0) if want_lp else None,
                "finish_reason": finish[i],
            }
        choices.append(choice)
    return web.json_response(
        {
            "id": gen.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": gen.created,
            "model": model,
            "choices": choices,
            "usage": gen.usage(),
        }
    )


async def _stream(
    request: web.Request, gw: GatewayState, gen: Generation, model: str, chat: bool
) -> web.StreamResponse:
    spec = gen.spec
    updates = gen.updates()
    # Wait for the first event before answering: an error (queue full, prompt too long) then
    # still gets its proper HTTP status instead of a 200 stream.
    first = await anext(updates)
    resp = await sse.open_stream(request)

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        c = {
            "id": gen.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": gen.created,
            "model": model,
            "choices": choices,
        }
        if spec.include_usage:
            c["usage"] = None
        return c

    text_offsets = [0] * spec.n
    template = sse.ChunkTemplate(
        {
            "id": gen.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": gen.created,
            "model": model,
        },
        chat,
        spec.include_usage,
    )

    def choice(u: ChoiceUpdate) -> dict[str, Any] | None:
        if not u.text and not u.logprobs and u.finish_reason is None:
            return None
        if chat:
            return {
                "index": u.index,
                "delta": {"content": u.text} if u.text else {},
                "logprobs": chat_logprobs(gw, u.logprobs) if u.logprobs else None,
                "finish_reason": u.finish_reason,
            }
        lp = completion_logprobs(gw, u.logprobs, text_offsets[u.index]) if u.logprobs else None
        text_offsets[u.index] += len(u.text)
        return {"index": u.index, "text": u.text, "logprobs": lp, "finish_reason": u.finish_reason}

    try:
        try:
            if chat:
                roles = [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(spec.n)
                ]
                for r in roles:
                    await resp.write(sse.event(chunk([r])))

            async def send(u: ChoiceUpdate) -> None:
                if u.logprobs is None:
                    # The common case, once per request per engine step: no dicts, no JSON encoder.
                    if u.text or u.finish_reason is not None:
                        if not chat:
                            text_offsets[u.index] += len(u.text)
                        await resp.write(template.choice(u.index, u.text, u.finish_reason))
                    return
                c = choice(u)
                if c is not None:
                    await resp.write(sse.event(chunk([c])))

            await send(first)
            async for u in updates:
                await send(u)
            if spec.include_usage:
                final = chunk([])
                final["usage"] = gen.usage()
                await resp.write(sse.event(final))
        except APIError as e:
            # Headers are gone already: report in-band, the way OpenAI-compatible servers do.
            await resp.write(sse.event(e.body()))
        await resp.write(sse.DONE)
        await resp.write_eof()
    except ConnectionError as e:
        # The client went away mid-stream: normal for a streaming API. close() aborts what still
        # runs (counted as "abort"); the middleware reports 499. One line, no traceback.
        logger.info("client left mid-stream (%s): %s", gen.request_id, type(e).__name__)
        request[CLIENT_GONE] = True
    return resp
