"""Structured logging for every service: one line per record, `key=value` (default) or JSON.

Quiet by default (WARNING, plus one INFO line per start-up phase); `--log-level info|debug`
makes a service talk. Call `setup_logging` once in a service's main(), and
`add_log_level_flag` when building its argparse parser. `warn_once` logs a warning the first
time a condition is met in a process (a load-time fact that would repeat per layer or tensor).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

LEVELS = ("debug", "info", "warning", "error", "critical")

# The keys warn_once has logged in this process.
_warned: set[str] = set()


class KeyValueFormatter(logging.Formatter):
    def __init__(self, service: str, json_lines: bool = False) -> None:
        super().__init__()
        self.service = service
        self.json_lines = json_lines

    def format(self, record: logging.LogRecord) -> str:
        fields = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # Structured extras: logger.info("...", extra={"kv": {"request_id": ...}}).
        kv = getattr(record, "kv", None)
        if isinstance(kv, dict):
            fields.update(kv)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        if self.json_lines:
            return json.dumps(fields, default=str)
        return " ".join(f"{k}={_quote(v)}" for k, v in fields.items())


def _quote(v: object) -> str:
    s = str(v)
    if not s or any(c in s for c in ' "=\n\t'):
        return json.dumps(s)
    return s


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default=os.environ.get("VOLTSERVE_LOG_LEVEL", "warning"),
        choices=LEVELS,
        help="log verbosity (default: warning; env VOLTSERVE_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-json",
        action="store_true",
        default=os.environ.get("VOLTSERVE_LOG_JSON", "") not in ("", "0"),
        help="log JSON lines instead of key=value",
    )


def setup_logging(service: str, level: str = "warning", json_lines: bool = False) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter(service, json_lines))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Third-party chatter stays at WARNING even when we debug ourselves.
    # numba's CUDA driver logs every module unload at INFO (dozens of lines per graph capture);
    # redis-py a line per new connection at DEBUG.
    for noisy in ("asyncio", "aiohttp.access", "urllib3", "filelock", "numba", "redis"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    # The start-up phase lines (one per phase, with its time) show at the default level too:
    # where a slow start spends its time is what an operator needs first.
    quiet = root.level > logging.WARNING  # --log-level error: quiet
    logging.getLogger("voltserve.startup").setLevel(
        root.level if quiet else min(root.level, logging.INFO)
    )


def log_once(logger: logging.Logger, level: int, key: str, msg: str, *args: object) -> None:
    """logger.log(level, msg, *args), unless a message under `key` was logged before in this
    process (the key names the condition; the first call's arguments are the ones logged)."""
    if key not in _warned:
        _warned.add(key)
        logger.log(level, msg, *args)


def warn_once(logger: logging.Logger, key: str, msg: str, *args: object) -> None:
    """log_once at WARNING."""
    log_once(logger, logging.WARNING, key, msg, *args)
