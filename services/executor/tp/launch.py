"""Starting a tensor-parallel group: rank 0 is the executor process itself (engine loop, Redis
I/O, sampler); it spawns ranks 1..N-1 as fresh processes (torch.multiprocessing, spawn), each
loading its own shards on its own device and then running `worker_loop` (tp/worker.py).

Failure is loud and total: a watchdog thread in rank 0 ends the executor (exit code 1) when a
rank exits, so its heartbeat stops and the scheduler fails its requests over; a watchdog in each
rank ends it when rank 0 is gone."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import replace

import torch
import torch.multiprocessing as mp
from voltserve.services.executor.tp.group import TPGroup, set_tp_env
from voltserve.shared import startup
from voltserve.shared.config import EngineConfig

logger = logging.getLogger(__name__)

RANK_DIED_EXIT_CODE = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a group runs on the r-th visible GPU (the launcher gives each group its own
    CUDA_VISIBLE_DEVICES), or on the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def check_devices(device: torch.device, size: int) -> None:
    if device.type != "cuda":
        return
    n = torch.cuda.device_count()
    if size > n:
        raise startup.StartupError(
            f"--tensor-parallel-size {size} needs {size} GPUs but {n} are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )


class RankProcesses:
    """Ranks 1..N-1 of the group, as seen from rank 0."""

    def __init__(
        self, config: EngineConfig, size: int, port: int, compile_only: bool = False
    ) -> None:
        set_tp_env()  # inherited by every rank's process
        ctx = mp.get_context("spawn")
        # Not daemonic: a rank may start compile workers of its own. The watchdogs and
        # `stop` end them instead.
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(config, r, size, port, os.getpid(), compile_only),
                name=f"tp-rank-{r}",
            )
            for r in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self.stopping = False
        self.compile_only = compile_only
        self._watch = threading.Thread(target=self._watchdog, name="tp-watchdog", daemon=True)
        self._watch.start()

    def _watchdog(self) -> None:
        while not self.stopping:
            self._exit_on_dead_rank()
            time.sleep(0.2)

    def _exit_on_dead_rank(self) -> None:
        """A rank that exited ends the executor (exit code RANK_DIED_EXIT_CODE), naming it."""
        for r, p in enumerate(self.procs, start=1):
            done = self.compile_only and p.exitcode == 0  # its compile phase ended
            if p.exitcode is not None and not self.stopping and not done:
                logger.critical(
                    "tensor-parallel rank %d (pid %s) exited with code %s: stopping the executor",
                    r,
                    p.pid,
                    p.exitcode,
                )
                logging.shutdown()
                os._exit(RANK_DIED_EXIT_CODE)

    def exit_if_a_rank_died(self, wait_s: float) -> None:
        """After a failed collective: wait up to wait_s for a rank's exit to show, and end the
        executor naming it; return if every rank is still alive."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            self._exit_on_dead_rank()
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
                p.join(2.0)


def _parent_watchdog(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(RANK_DIED_EXIT_CODE)
        time.sleep(0.5)


def worker_main(
    config: EngineConfig, rank: int, size: int, port: int, parent: int, compile_only: bool = False
) -> None:
    """Rank `rank` (>= 1): load the shards, join the start-up collectives, serve steps.
    compile_only (`voltserve warmup`): stop after the compile phase, as rank 0 does."""
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.services.executor.tp.worker import worker_loop
    from voltserve.shared.logging import setup_logging

    setup_logging(f"executor-tp{rank}", os.environ.get("VOLTSERVE_LOG_LEVEL", "info"), False)
    threading.Thread(target=_parent_watchdog, args=(parent,), daemon=True).start()
    try:
        runner = ModelRunner(replace(config), compile_only, tp_rank=rank, tp_port=port)
    except Exception:
        # A load error here is rank 0's too (each rank narrows the same way): give rank 0
        # the time to report it and stop the group, rather than a bare "rank exited".
        logger.exception("tensor-parallel rank %d failed to start", rank)
        time.sleep(2.0)
        raise
    if not compile_only:
        startup.freeze_heap()
        worker_loop(runner)
    runner.tp.destroy()


def start_group(
    config: EngineConfig, device: torch.device, compile_only: bool = False
) -> tuple[TPGroup, RankProcesses, int]:
    """Rank 0's half: spawn the other ranks and join the group with them."""
    size = config.tensor_parallel_size
    check_devices(device, size)
    port = free_port()
    procs = RankProcesses(config, size, port, compile_only)
    try:
        group = TPGroup.init(0, size, port, rank_device(device, 0))
    except BaseException:
        # The ranks would wait for rank 0 forever (and the exit would wait for them).
        procs.stopping = True
        procs.stop(timeout=1.0)
        raise
    return group, procs, port
