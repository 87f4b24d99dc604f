"""`voltserve executor`: one engine (one GPU) behind Redis streams."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import socket

from voltserve.services.executor.architectures import check_model_folder
from voltserve.services.executor.engine_args import add_engine_flags, engine_config
from voltserve.shared import broker, startup
from voltserve.shared.logging import add_log_level_flag, setup_logging

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="voltserve executor", description=__doc__)
    add_engine_flags(p)
    p.add_argument(
        "--executor-id",
        default=os.environ.get("VOLTSERVE_EXECUTOR_ID") or f"{socket.gethostname()}-{os.getpid()}",
    )
    broker.add_broker_flags(p)
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds")
    p.add_argument(
        "--heartbeat-ttl",
        type=float,
        default=3.0,
        help="seconds; the scheduler fails over after this",
    )
    p.add_argument("--served-model-name", default=None, help="model_name label of the metrics")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    add_log_level_flag(p)
    return p


def service_config(args: argparse.Namespace):
    """The service half of the executor flags (shared with load_tests/synthetic_executor.py)."""
    from voltserve.services.executor.service import ServiceConfig

    return ServiceConfig(
        executor_id=args.executor_id,
        redis_url=args.redis_url,
        model=args.model,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_ttl_s=args.heartbeat_ttl,
        max_num_seqs=args.max_num_seqs,
        redis_outage_timeout_s=args.redis_outage_timeout,
    )


def run_until_signalled(svc) -> None:
    """Runs an ExecutorService until SIGINT or SIGTERM asks it to stop."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, svc.stop.set)
        await svc.run()

    asyncio.run(run())


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(f"executor:{args.executor_id}", args.log_level, args.log_json)
    # `kill -USR1 <pid>` prints every thread's stack: the way to see what a stuck engine does.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A failure that a restart cannot fix (the model, a flag, the memory) exits with
    # startup.FATAL_EXIT_CODE and its reason, so the launcher stops instead of retrying.
    with startup.fatal_errors(f"executor {args.executor_id}"):
        check_model_folder(args.model)
        # Imported here so `--help` and a refused folder do not pay for torch.
        from voltserve.services.executor.engine import LLMEngine
        from voltserve.services.executor.service import ExecutorService

        engine = LLMEngine(engine_config(args))
    svc = ExecutorService(engine, service_config(args))

    if args.metrics_port:
        from voltserve.shared import metrics

        metrics.serve_executor_metrics(
            args.metrics_port,
            args.executor_id,
            args.served_model_name or args.model,
            lambda: metrics.status_fields(svc.loop_.latest_stats, [svc.loop_.queue_time]),
        )

    startup.freeze_heap()
    try:
        run_until_signalled(svc)
    finally:
        engine.runner.shutdown()  # the other tensor-parallel ranks, if any
    logger.info("executor %s exited", args.executor_id)
