"""POST /v1/completions and /v1/chat/completions, streaming and not."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from voltserve.services.gateway import sse
from voltserve.services.gateway.body_limits import MAX_JSON_DEPTH, check_depth
from voltserve.services.gateway.detokenizer import token_text
from voltserve.services.gateway.errors import APIError, bad_request
from voltserve.services.gateway.generate import ChoiceUpdate, Generation, PromptInfo, TokenInfo
from voltserve.services.gateway.params import GenerationSpec, parse_chat, parse_completion
from voltserve.services.gateway.state import GatewayState
from voltserve.services.gateway.token_bytes import token_bytes
from voltserve.services.gateway.tools import ChatPlan, ChatTooling, plan_chat

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
    except RecursionError:
        raise bad_request(
            f"the request body is nested more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_depth(raw, body)
    # JSON may escape half of a surrogate pair ("\ud800"); no tokenizer or encoder takes that.
    # Only a body holding such an escape needs the walk (two scans cost less than a lowered copy
    # of a large body).
    if (b"\\ud" in raw or b"\\uD" in raw) and _has_lone_surrogate(body):
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


def _label(gw: GatewayState, tok: int, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or "token_id:N" (return_tokens_as_token_ids)."""
    return f"token_id:{tok}" if as_ids else token_text(gw.tokenizer, tok)


def chat_logprobs(gw: GatewayState, infos: list[TokenInfo], as_ids: bool = False) -> dict:
    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = token_text(gw.tokenizer, tok)
        label = f"token_id:{tok}" if as_ids else text
        return {"token": label, "logprob": lp, "bytes": token_bytes(gw.tokenizer, tok, text)}

    content = []
    for t in infos:
        e = entry(t.token_id, t.logprob)
        e["top_logprobs"] = [entry(tok, lp) for tok, lp in t.top]
        content.append(e)
    return {"content": content}


def completion_logprobs(
    gw: GatewayState, infos: list[TokenInfo | None], offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """Completions' logprobs; an entry None (the first echoed prompt token) has no logprob."""
    tokens, offsets, lps, tops = [], [], [], []
    for t in infos:
        tok = t.token_id if t is not None else None
        text = token_text(gw.tokenizer, tok) if tok is not None else ""
        tokens.append(f"token_id:{tok}" if as_ids else text)
        offsets.append(offset)
        offset += len(text)
        lps.append(t.logprob if t is not None and t.logprob is not None else None)
        tops.append(
            {_label(gw, a, as_ids): lp for a, lp in t.top}
            if t is not None and lps[-1] is not None
            else None
        )
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _echo_infos(prompt: PromptInfo) -> list[TokenInfo | None]:
    """Prompt tokens as completion logprob entries (a token without a logprob keeps its id)."""
    return [
        info if info is not None else TokenInfo(tok, None, [])  # type: ignore[arg-type]
        for tok, info in zip(prompt.token_ids, prompt.logprobs)
    ]


def vllm_prompt_logprobs(gw: GatewayState, prompt: PromptInfo, as_ids: bool = False) -> list:
    """vLLM's prompt_logprobs: None for the first token, then {token_id: {logprob, rank,
    decoded_token}} holding the prompt token and the top N."""
    out: list[dict[str, Any] | None] = []
    for tok, info, rank in zip(prompt.token_ids, prompt.logprobs, prompt.ranks):
        if info is None:
            out.append(None)
            continue
        d = {
            str(tok): {
                "logprob": info.logprob,
                "rank": rank,
                "decoded_token": _label(gw, tok, as_ids),
            }
        }
        for r, (t, lp) in enumerate(info.top, start=1):
            d.setdefault(str(t), {"logprob": lp, "rank": r, "decoded_token": _label(gw, t, as_ids)})
        out.append(d)
    return out


# ---- the two endpoints ---------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw: GatewayState = request.app["gw"]
    body = await read_json(request)
    model = check_model(gw, body)
    spec = parse_chat(body, gw.renderer.vocab_size, gw.max_model_len)
    plan = plan_chat(body, spec, gw.tooling or ChatTooling())
    return await _serve(request, gw, spec, model, chat=True, plan=plan)


async def completions(request: web.Request) -> web.StreamResponse:
    gw: GatewayState = request.app["gw"]
    body = await read_json(request)
    model = check_model(gw, body)
    spec = parse_completion(body, gw.renderer.vocab_size, gw.max_model_len)
    return await _serve(request, gw, spec, model, chat=False)


async def _serve(
    request: web.Request,
    gw: GatewayState,
    spec: GenerationSpec,
    model: str,
    chat: bool,
    plan: ChatPlan | None = None,
) -> web.StreamResponse:
    gen = Generation(gw, spec, "chatcmpl" if chat else "cmpl")
    plan = plan or ChatPlan()
    try:
        await gen.start()
        if spec.stream:
            return await _stream(request, gw, gen, model, chat, plan)
        return await _complete(gw, gen, model, chat, plan)
    finally:
        gen.close()


def _echo_text(gw: GatewayState, spec: GenerationSpec, prompt: PromptInfo | None) -> str:
    if isinstance(spec.prompt, str):
        return spec.prompt
    ids = prompt.token_ids if prompt is not None else list(spec.prompt or [])
    return gw.tokenizer.decode(ids, skip_special_tokens=False)


async def _complete(
    gw: GatewayState, gen: Generation, model: str, chat: bool, plan: ChatPlan
) -> web.Response:
    spec = gen.spec
    n = spec.n
    as_ids = spec.return_tokens_as_token_ids
    texts = [[] for _ in range(n)]
    infos: list[list[TokenInfo]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    prompts: list[PromptInfo | None] = [None] * n
    async for u in gen.updates():
        texts[u.index].append(u.text)
        if u.logprobs:
            infos[u.index].extend(u.logprobs)
        if u.finish_reason:
            finish[u.index] = u.finish_reason
        if u.prompt is not None:
            prompts[u.index] = u.prompt
    want_lp = spec.params.logprobs is not None
    want_plp = spec.params.prompt_logprobs is not None
    choices = []
    for i in range(n):
        text = "".join(texts[i])
        if chat:
            out = plan.output()
            message = (
                out.message(text) if not plan.plain else {"role": "assistant", "content": text}
            )
            choice = {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(gw, infos[i], as_ids) if want_lp else None,
                "finish_reason": out.finish_reason(finish[i]),
            }
        else:
            lp = None
            if spec.echo:
                text = _echo_text(gw, spec, prompts[i]) + text
            if want_lp:
                entries: list[TokenInfo | None] = list(infos[i])
                if spec.echo and prompts[i] is not None:
                    entries = _echo_infos(prompts[i]) + entries
                lp = completion_logprobs(gw, entries, 0, as_ids)
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]}
            if want_plp:
                pi = prompts[i]
                choice["prompt_logprobs"] = vllm_prompt_logprobs(gw, pi, as_ids) if pi else None
        choices.append(choice)
    body: dict[str, Any] = {
        "id": gen.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": gen.created,
        "model": model,
        "choices": choices,
        "usage": gen.usage(),
    }
    if chat and want_plp:
        # vLLM puts a chat request's prompt logprobs beside the choices (one prompt for all).
        body["prompt_logprobs"] = (
            vllm_prompt_logprobs(gw, prompts[0], as_ids) if prompts[0] is not None else None
        )
    return web.json_response(body, dumps=sse.dumps)


async def _stream(
    request: web.Request,
    gw: GatewayState,
    gen: Generation,
    model: str,
    chat: bool,
    plan: ChatPlan,
) -> web.StreamResponse:
    spec = gen.spec
    updates = gen.updates()
    # Wait for the first event before answering: an error (queue full, prompt too long) then
    # still gets its proper HTTP status instead of a 200 stream.
    first = await anext(updates)
    resp = await sse.open_stream(request)
    as_ids = spec.return_tokens_as_token_ids
    want_plp = spec.params.prompt_logprobs is not None
    continuous = spec.include_usage and spec.continuous_usage_stats

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        c = {
            "id": gen.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": gen.created,
            "model": model,
            "choices": choices,
        }
        if spec.include_usage:
            c["usage"] = gen.usage() if continuous else None
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
    # The pre-encoded chunk serves plain text deltas; everything else builds its chunk.
    fast = (not chat or plan.plain) and not (spec.echo or continuous or want_plp)
    outputs = [plan.output() for _ in range(spec.n)] if chat and not plan.plain else None
    first_seen = [False] * spec.n

    def event(u: ChoiceUpdate) -> bytes | None:
        i = u.index
        opening = not first_seen[i]
        first_seen[i] = True
        final = u.finish_reason is not None
        extra: dict[str, Any] = {}
        if chat:
            if outputs is not None:
                delta = outputs[i].feed(u.text, final)
                finish = outputs[i].finish_reason(u.finish_reason)
            else:
                delta, finish = ({"content": u.text} if u.text else {}), u.finish_reason
            if want_plp and u.prompt is not None:
                extra["prompt_logprobs"] = vllm_prompt_logprobs(gw, u.prompt, as_ids)
            if not delta and not u.logprobs and finish is None and not extra:
                return None
            c = chunk(
                [
                    {
                        "index": i,
                        "delta": delta,
                        "logprobs": chat_logprobs(gw, u.logprobs, as_ids) if u.logprobs else None,
                        "finish_reason": finish,
                    }
                ]
            )
            c.update(extra)
            return sse.event(c)
        text = u.text
        entries: list[TokenInfo | None] = list(u.logprobs or [])
        if spec.echo and opening:
            text = _echo_text(gw, spec, u.prompt) + text
            if spec.params.logprobs is not None and u.prompt is not None:
                entries = _echo_infos(u.prompt) + entries
        lp = completion_logprobs(gw, entries, text_offsets[i], as_ids) if entries else None
        text_offsets[i] += len(text)
        ch: dict[str, Any] = {
            "index": i,
            "text": text,
            "logprobs": lp,
            "finish_reason": u.finish_reason,
        }
        if want_plp and u.prompt is not None:
            ch["prompt_logprobs"] = vllm_prompt_logprobs(gw, u.prompt, as_ids)
        if not text and lp is None and u.finish_reason is None and "prompt_logprobs" not in ch:
            return None
        return sse.event(chunk([ch]))

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
                if fast and u.logprobs is None:
                    # The common case, once per request per engine step: no dicts, no JSON encoder.
                    if u.text or u.finish_reason is not None:
                        if not chat:
                            text_offsets[u.index] += len(u.text)
                        await resp.write(template.choice(u.index, u.text, u.finish_reason))
                    return
                e = event(u)
                if e is not None:
                    await resp.write(e)

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
