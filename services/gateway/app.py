"""The aiohttp application: middleware (auth, errors, request metrics) and the small endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError
from voltserve.services.gateway import anthropic_errors, params, protocol_routes, routes, web_ui
from voltserve.services.gateway.auth import check_api_key
from voltserve.services.gateway.body_limits import check_content_length, too_large
from voltserve.services.gateway.broker_outage import LostRequestWatch, unavailable
from voltserve.services.gateway.errors import APIError, bad_request
from voltserve.services.gateway.state import GatewayState
from voltserve.services.renderer.render import RenderFailed
from voltserve.shared import broker, streams

logger = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 10.0
READY_CACHE_S = 1.0


@web.middleware
async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    gw: GatewayState = request.app["gw"]
    status = 500
    try:
        check_api_key(request, gw.api_key)
        check_content_length(request, gw.max_request_bytes)
        # Reads (/health, /v1/models, /metrics) answer at once while the broker is away.
        reading = request.method in ("GET", "HEAD")
        with broker.fail_fast() if reading else contextlib.nullcontext():
            if request.method == "POST" or request.path == "/v1/models":
                await gw.refresh_limits()
            resp = await handler(request)
        status = 499 if request.get(routes.CLIENT_GONE) else resp.status
        return resp
    except APIError as e:
        status = e.status
        resp = e.response()
        if e.status == 413:
            resp.force_close()  # the rest of the body is not read: this connection is done
        return resp
    except RenderFailed as e:  # the executors' limits are not known yet (render.LimitsUnknown)
        status = e.status
        return APIError(e.status, e.message, param=e.param).response()
    except RedisConnectionError as e:
        status = 503
        return unavailable(gw.redis, e).response()
    except web.HTTPException as e:
        status = e.status
        if e.status == 413:  # a chunked body past the app's client_max_size
            resp = too_large(gw.max_request_bytes).response()
            resp.force_close()
            return resp
        if e.status >= 400:
            return APIError(e.status, e.reason or "error").response()
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away
        raise
    except Exception as e:
        logger.exception("unhandled error on %s", request.path)
        return APIError(500, f"internal error: {type(e).__name__}: {e}").response()
    finally:
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unknown"
        gw.metrics.http_requests.labels(endpoint, str(status)).inc()


async def executors_ready(gw: GatewayState, app: web.Application) -> bool:
    """True when at least one executor's heartbeat is alive (cached briefly)."""
    now = time.monotonic()
    cached = app.get("ready_cache")
    if cached is not None and now - cached[0] < READY_CACHE_S:
        return cached[1]
    ids = await gw.redis.smembers(streams.executors_key())
    ready = False
    if ids:
        keys = [streams.executor_alive_key(i.decode()) for i in ids]
        ready = bool(await gw.redis.exists(*keys))
    app["ready_cache"] = (now, ready)
    return ready


async def health(request: web.Request) -> web.Response:
    gw: GatewayState = request.app["gw"]
    link = broker.link_of(gw.redis)
    try:
        ready = await executors_ready(gw, request.app)
    except broker.BrokerUnavailable:
        ready = False
    if link is not None and link.down:
        body = {
            "status": "broker_unavailable",
            "message": link.unavailable_message(),
            "broker": link.status(),
        }
        return web.json_response(body, status=503)
    if not ready:
        return web.json_response({"status": "starting"}, status=503)
    return web.json_response({"status": "ok"})


async def version(request: web.Request) -> web.Response:
    from voltserve import __version__

    return web.json_response({"version": __version__})


async def ping(request: web.Request) -> web.Response:
    """vLLM's liveness probe: the same answer as /health."""
    return await health(request)


async def models(request: web.Request) -> web.Response:
    gw: GatewayState = request.app["gw"]
    # A model is listed only once an executor can serve it and has published the context it
    # enforces (none while starting).
    listed = gw.renderer.limits is not None and await executors_ready(gw, request.app)
    data = [
        {
            "id": name,
            "object": "model",
            "created": request.app["started"],
            "owned_by": "voltserve",
            "root": gw.model_path,
            "parent": None,
            "max_model_len": gw.max_model_len,
        }
        for name in (gw.served_model_names if listed else [])
    ]
    return web.json_response({"object": "list", "data": data})


async def tokenize(request: web.Request) -> web.Response:
    gw: GatewayState = request.app["gw"]
    body = await routes.read_json(request)
    if body.get("model") is not None:
        routes.check_model(gw, body)
    add_special = params.get(body, "add_special_tokens", (bool,), True)
    # In a worker thread (the tokenizer releases the GIL), bounded by the context like a prompt:
    # a long text is refused before it is tokenized in full.
    try:
        if "messages" in body:
            ids = await asyncio.to_thread(
                gw.renderer.tokenize_chat,
                body["messages"],
                params.get(body, "add_generation_prompt", (bool,), True),
                params.get(body, "chat_template_kwargs", (dict,), None),
            )
        elif isinstance(body.get("prompt"), str):
            ids = await asyncio.to_thread(
                gw.renderer.tokenize_text, body["prompt"], add_special, "prompt"
            )
        else:
            raise bad_request("give `prompt` (a string) or `messages`", "prompt")
    except RenderFailed as e:
        raise APIError(e.status, e.message, param=e.param) from e
    return web.json_response({"count": len(ids), "max_model_len": gw.max_model_len, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    gw: GatewayState = request.app["gw"]
    body = await routes.read_json(request)
    if body.get("model") is not None:
        routes.check_model(gw, body)
    tokens = body.get("tokens")
    vocab = gw.renderer.vocab_size
    if isinstance(tokens, list) and len(tokens) > gw.max_model_len:
        raise bad_request(
            f"tokens may hold at most max_model_len ({gw.max_model_len}) ids, got {len(tokens)}",
            "tokens",
        )
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
    ):
        raise bad_request(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    return web.json_response({"prompt": gw.tokenizer.decode(tokens)})


async def metrics(request: web.Request) -> web.Response:
    gw: GatewayState = request.app["gw"]
    data, content_type = await gw.metrics.render(gw.redis)
    resp = web.Response(body=data)
    resp.headers["Content-Type"] = content_type
    return resp


async def _heartbeat(gw: GatewayState, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await gw.redis.sadd(streams.gateways_key(), gw.gateway_id)
            await streams.set_heartbeat(
                gw.redis, streams.gateway_alive_key(gw.gateway_id), None, None, HEARTBEAT_TTL_S
            )
        except Exception as e:  # noqa: BLE001 - keep beating through Redis hiccups
            logger.error("gateway heartbeat failed: %s", e)
        try:
            await asyncio.wait_for(stop.wait(), HEARTBEAT_TTL_S / 3)
        except TimeoutError:
            pass


async def _background(app: web.Application) -> Any:
    gw: GatewayState = app["gw"]
    stop = asyncio.Event()
    await gw.dispatcher.start_position()
    tasks = [
        asyncio.create_task(gw.dispatcher.run(stop)),
        asyncio.create_task(_heartbeat(gw, stop)),
        asyncio.create_task(
            LostRequestWatch(gw.redis, gw.dispatcher, gw.lost_request_timeout_s).run(stop)
        ),
    ]
    yield
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if gw.background:
        await asyncio.gather(*gw.background, return_exceptions=True)
    await gw.redis.aclose()


def build_app(gw: GatewayState, web_page: bool = True) -> web.Application:
    # Anthropic's error shape on its routes is a rewrite of what `middleware` answers.
    app = web.Application(
        middlewares=[anthropic_errors.middleware, middleware],
        client_max_size=gw.max_request_bytes,
    )
    app["gw"] = gw
    app["started"] = int(time.time())
    app.cleanup_ctx.append(_background)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/responses", protocol_routes.responses)
    app.router.add_post("/v1/messages", protocol_routes.messages)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    if web_page:
        web_ui.add_routes(app)
    return app
