"""A runner's side of tensor parallelism: joining the group at start-up, rank 0's per-step
hand-off and shutdown, and the loop ranks 1..N-1 run (each step rank 0 broadcasts, on the same
flat batch or the same graph, so every collective pairs up)."""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
from voltserve.services.executor.input_batch import InputBatch, flat_batch
from voltserve.services.executor.loader import parse_arch, read_hf_config
from voltserve.services.executor.tp import launch as tp_launch
from voltserve.services.executor.tp.group import TPGroup
from voltserve.services.executor.tp.layout import TPLayout
from voltserve.services.executor.tp.sharding import TPSplitError
from voltserve.services.executor.tp.step_sync import EAGER, GRAPH, NUM_PARTS, STOP, StepSync
from voltserve.shared.config import EngineConfig
from voltserve.shared.gguf_files import is_gguf

if TYPE_CHECKING:
    from voltserve.services.executor.input_batch import DeviceBatch
    from voltserve.services.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

T = TypeVar("T")


def check_tp_model(config: EngineConfig) -> None:
    """Refuse, before any rank starts, a model that --tensor-parallel-size cannot split: heads,
    KV heads, MLP or expert widths not divisible. A quantized linear whose shard would cut a
    packed word, a quantization group or a GGUF block is refused by its method's shard rule
    while loading (naming the tensor and the sizes)."""
    size = config.tensor_parallel_size
    if config.speculative_config is not None:
        # The draft model and the verify step run on rank 0 alone; the other ranks would need
        # to follow both.
        method = config.speculative_config.method
        raise TPSplitError(
            f"--speculative-config with --tensor-parallel-size {size} is not supported yet "
            f"(method {method!r}); use one of them"
        )
    if is_gguf(config.model):
        from voltserve.services.executor.gguf_source import GGUFSource

        hf = GGUFSource(config.model).config
    else:
        hf = read_hf_config(config.model)
    TPLayout.build(parse_arch(hf), 0, size)


class TPSession:
    """This process's rank in a tensor-parallel group (rank 0 also holds the other ranks'
    processes)."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        rank: int,
        port: int | None,
        compile_only: bool,
    ) -> None:
        """device: the executor's device; self.device is this rank's."""
        self.rank = rank
        self.procs: tp_launch.RankProcesses | None = None
        self._compile_only = compile_only
        self._lock = threading.Lock()
        if device.type == "cuda":
            device = tp_launch.rank_device(device, rank)
        self.device = device
        if rank == 0:
            # Refuse a size the model or the host cannot take before starting any rank.
            check_tp_model(config)
            self.group, self.procs, _ = tp_launch.start_group(config, device, compile_only)
            # Before multiprocessing's own exit hook, which would wait forever for ranks
            # still waiting for a step.
            atexit.register(self.shutdown)
        else:
            self.group = TPGroup.init(rank, config.tensor_parallel_size, port, device)
        self.sync = StepSync(self.group)

    # ---- rank 0 ----------------------------------------------------------------------------

    def run(self, step: Callable[[], T]) -> T:
        """One step, with one thread at a time talking to the group: a step's broadcasts and
        collectives never interleave with the stop broadcast of `shutdown` (called from
        another thread)."""
        with self._lock:
            if self.procs is None:
                raise RuntimeError("the tensor-parallel group has been shut down")
            try:
                return step()
            except Exception:
                # A collective fails as soon as a peer's connection closes, often before the
                # watchdog's next poll sees the rank's exit: name the dead rank if there is one
                # (this exits the process), else let the error end the executor as it is.
                self.procs.exit_if_a_rank_died(wait_s=2.0)
                raise

    def send_eager(self, staged: InputBatch, batch: DeviceBatch) -> None:
        """Before an eager forward: the other ranks get its flat batch."""
        self.sync.send_eager(
            staged.dev[: staged.last_n_all],
            staged.last_lengths,
            batch.num_seqs,
            batch.meta.block_tables.shape[1],
            batch.meta.is_decode,
            batch.meta.max_query_len or 0,
        )

    def send_graph_step(self, bs: int, staged: torch.Tensor) -> None:
        """Before replaying the bs graph: the other ranks get its staged inputs."""
        self.sync.send_graph(bs, staged)

    def abort(self) -> None:
        """During start-up: end the other ranks without a stop broadcast (they are not serving
        steps yet)."""
        procs, self.procs = self.procs, None
        if procs is not None:
            procs.stopping = True
            procs.stop(timeout=5.0)
        self.group.destroy()

    def shutdown(self) -> None:
        """Rank 0: tell the other ranks to exit and wait for them (idempotent)."""
        if self.procs is None:
            return
        # A step in flight finishes first (the engine thread is not joined on the way out).
        locked = self._lock.acquire(timeout=30)
        procs, self.procs = self.procs, None
        if procs is None:
            return
        procs.stopping = True
        try:
            if not self._compile_only:  # compile-only ranks exit after the compile phase
                self.sync.send_stop()
        except Exception:  # noqa: BLE001 (a rank already gone: stop kills the rest)
            logger.warning("tensor-parallel stop broadcast failed", exc_info=True)
        procs.stop()
        self.group.destroy()
        if locked:
            self._lock.release()


@torch.inference_mode()
def worker_loop(runner: ModelRunner) -> None:
    """Ranks 1..N-1: run each step rank 0 broadcasts until it says stop. The forward is the
    one rank 0 runs (same flat batch, same graph), so every collective pairs up."""
    session = runner.tp_session
    sync, group = session.sync, session.group
    while True:
        hdr = sync.recv_header()
        kind = hdr[0]
        if kind == STOP:
            return
        if kind == GRAPH:
            bs, nbytes = hdr[1], hdr[2]
            g = runner.graphs
            group.broadcast(g.st.device_bytes(nbytes))
            g.graphs[bs].replay()
            continue
        if kind != EAGER:
            raise RuntimeError(f"tensor-parallel rank {session.rank}: bad step header {hdr}")
        B, width, decode, mql = hdr[1:5]
        lengths = hdr[5 : 5 + NUM_PARTS]
        flat = runner.input_batch.device_buffer(sum(lengths))
        group.broadcast(flat)
        batch = flat_batch(list(flat.split(lengths)), B, width, bool(decode), mql)
        runner.model(
            batch.input_ids, batch.positions, batch.meta, runner.kv_caches, batch.logits_indices
        )
