"""`voltserve gateway`: the OpenAI-compatible HTTP front end."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import uuid

from aiohttp import web
from voltserve.services.gateway.app import build_app
from voltserve.services.gateway.body_limits import (
    DRAIN_S,
    add_request_flags,
    default_max_request_bytes,
)
from voltserve.services.gateway.broker_outage import LOST_AFTER_S
from voltserve.services.gateway.dispatcher import OutputDispatcher
from voltserve.services.gateway.metrics import GatewayMetrics
from voltserve.services.gateway.reasoning_parsers import REASONING_PARSERS
from voltserve.services.gateway.state import GatewayState
from voltserve.services.gateway.tool_parsers import TOOL_PARSERS
from voltserve.services.gateway.tools import ChatTooling
from voltserve.services.gateway.web_ui import add_web_ui_flag
from voltserve.services.renderer.render import Renderer, position_limit
from voltserve.shared import broker, startup, streams
from voltserve.shared.logging import add_log_level_flag, setup_logging
from voltserve.shared.model_limits import PublishedLimits
from voltserve.shared.torch_free import keep_torch_out

logger = logging.getLogger(__name__)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="voltserve gateway", description=__doc__)
    broker.add_broker_flags(p)
    p.add_argument("--model", required=True, help="model folder (for the tokenizer)")
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients use (default: --model)"
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    p.add_argument("--gateway-id", default=None, help="default: a random id")
    add_request_flags(p)
    add_tool_flags(p)
    add_web_ui_flag(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument(
        "--lost-request-timeout",
        type=broker.positive_seconds,
        default=LOST_AFTER_S,
        help="seconds a request in flight across a broker restart may go without output and "
        f"untracked by the scheduler before it ends with a 503 (default {LOST_AFTER_S:.0f})",
    )
    add_log_level_flag(p)
    return p.parse_args(argv)


def add_tool_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for tool calling and reasoning output (`voltserve serve` passes them on)."""
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls out of the output for tool_choice "auto" (needs --tool-call-parser)',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the model's tool-call format",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> into reasoning_content",
    )


def tool_flags_argv(args: argparse.Namespace) -> list[str]:
    out = ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    if args.tool_call_parser:
        out += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        out += ["--reasoning-parser", args.reasoning_parser]
    return out


def build_state(args: argparse.Namespace) -> GatewayState:
    # An unreadable tokenizer or config will not fix itself: exit with the fatal code.
    with startup.fatal_errors("gateway", also=(OSError,)):
        renderer = Renderer(args.model, tokenizer_path=args.tokenizer)
        # Buffers sized before an executor published its limits: by the model's own longest
        # context, which bounds every executor's (render.position_limit).
        ceiling = position_limit(args.model)
    names = args.served_model_name or [args.model]
    gateway_id = args.gateway_id or uuid.uuid4().hex[:12]
    try:
        tooling = ChatTooling.from_flags(
            args.enable_auto_tool_choice,
            args.tool_call_parser,
            args.reasoning_parser,
            renderer.tokenizer,
        )
    except ValueError as e:
        raise SystemExit(f"voltserve gateway: {e}") from e
    redis = streams.connect(args.redis_url, outage_timeout_s=args.redis_outage_timeout)
    return GatewayState(
        redis=redis,
        gateway_id=gateway_id,
        renderer=renderer,
        served_model_names=names,
        model_path=args.model,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes
        or default_max_request_bytes(ceiling, renderer.span.max_token_bytes),
        metrics=GatewayMetrics(names[0], ceiling),
        dispatcher=OutputDispatcher(redis, gateway_id),
        tooling=tooling,
        limits=PublishedLimits(redis),
        lost_request_timeout_s=args.lost_request_timeout,
    )


def make_app(args: argparse.Namespace) -> web.Application:
    return build_app(build_state(args), web_page=not args.no_web_ui)


async def serve(args: argparse.Namespace) -> None:
    app = make_app(args)
    # Handlers are cancelled when the client disconnects: that is how an abort reaches the
    # engine for a request whose client went away.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, lingering_time=DRAIN_S)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    startup.freeze_heap()
    logger.info("gateway %s listening on %s:%d", app["gw"].gateway_id, args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    keep_torch_out(args.model, args.tokenizer)
    setup_logging("gateway", args.log_level, args.log_json)
    asyncio.run(serve(args))
    # Everything is closed. Skip the interpreter's teardown of the tokenizer's large object
    # graph, which takes seconds on a busy machine and makes a clean stop look like a hang.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
