"""POST /v1/responses (OpenAI's Responses API) and POST /v1/messages (Anthropic's Messages API):
each request is translated to the internal chat request and served by the chat machinery
(chat_bridge.py); only the request's and the output's shapes are the protocol's own."""

from __future__ import annotations

from aiohttp import web
from voltserve.services.gateway.chat_bridge import Run, prepare
from voltserve.services.gateway.messages_output import MessageBuilder, MessagesStream
from voltserve.services.gateway.messages_request import parse_messages
from voltserve.services.gateway.responses_output import ResponseBuilder, ResponsesStream
from voltserve.services.gateway.responses_request import parse_responses
from voltserve.services.gateway.routes import check_model, read_json
from voltserve.services.gateway.state import GatewayState


def _has_reasoning_parser(gw: GatewayState) -> bool:
    return gw.tooling is not None and gw.tooling.reasoning_parser is not None


async def responses(request: web.Request) -> web.StreamResponse:
    gw: GatewayState = request.app["gw"]
    body = await read_json(request)
    model = check_model(gw, body)
    req = parse_responses(body, _has_reasoning_parser(gw))
    spec, plan = prepare(gw, req.call)
    run = Run(gw, spec, plan, req.call, "resp")
    builder = ResponseBuilder(f"resp_{run.id_hex}", model, req.echo, gw.tokenizer)
    if req.stream:
        return await run.stream(request, lambda _: ResponsesStream(builder))
    blocks, ending = await run.whole()
    return web.json_response(builder.whole(blocks, ending))


async def messages(request: web.Request) -> web.StreamResponse:
    gw: GatewayState = request.app["gw"]
    body = await read_json(request)
    model = check_model(gw, body)
    req = parse_messages(body, _has_reasoning_parser(gw))
    spec, plan = prepare(gw, req.call)
    run = Run(gw, spec, plan, req.call, "msg")
    builder = MessageBuilder(f"msg_{run.id_hex}", model, req.thinking_omitted)
    if req.stream:
        return await run.stream(request, lambda _: MessagesStream(builder))
    blocks, ending = await run.whole()
    return web.json_response(builder.whole(blocks, ending))
