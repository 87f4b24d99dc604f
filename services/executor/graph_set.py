"""The CUDA-graph abstraction the decode graphs (cuda_graphs.py) and speculation's graphs
(spec/graphs.py) share: static inputs as typed views of one device byte buffer with a pinned
host twin (one copy per step), one graph per captured batch size (captured largest first into
one memory pool), and the padding of a batch to the smallest captured size that holds it."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from voltserve.shared import startup

logger = logging.getLogger(__name__)


def padded_size(sizes: Sequence[int], n: int) -> int | None:
    """The captured size a batch of n sequences replays (the smallest >= n); None: none."""
    if n < 1:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class Staging:
    """Named fields as typed views of one device byte buffer, with a pinned host twin (numpy
    views) of the same layout; `upload(nbytes)` moves its first nbytes in one copy."""

    def __init__(self, fields: list[tuple[str, torch.dtype, tuple[int, ...]]], device) -> None:
        offs, off = {}, 0
        for name, dt, shape in fields:
            size = torch.empty((), dtype=dt).element_size()
            off = -(-off // size) * size
            offs[name] = off
            off += size * int(np.prod(shape))
        self.nbytes = off
        self.offsets = offs
        pin = torch.device(device).type == "cuda"
        self._host = torch.zeros(off, dtype=torch.uint8, pin_memory=pin)
        self._dev = torch.zeros(off, dtype=torch.uint8, device=device) if pin else self._host
        self._copy_done = torch.cuda.Event() if pin else None
        self.dev: dict[str, torch.Tensor] = {}
        self.host: dict[str, np.ndarray] = {}
        for name, dt, shape in fields:
            n = int(np.prod(shape))
            a = offs[name]
            b = a + n * torch.empty((), dtype=dt).element_size()
            self.dev[name] = self._dev[a:b].view(dt).view(shape)
            self.host[name] = self._host[a:b].view(dt).view(shape).numpy()

    def end_of(self, name: str, rows: int) -> int:
        """The byte just past rows [0, rows) of field name."""
        row = self.dev[name][0].numel() * self.dev[name].element_size()
        return self.offsets[name] + rows * row

    def wait(self) -> None:
        """The previous upload has left the host twin (it may be written again)."""
        if self._copy_done is not None:
            self._copy_done.synchronize()

    def upload(self, nbytes: int) -> None:
        if self._dev is not self._host:
            self._dev[:nbytes].copy_(self._host[:nbytes], non_blocking=True)
            self._copy_done.record()

    def device_bytes(self, nbytes: int) -> torch.Tensor:
        """The first nbytes of the device buffer (a tensor-parallel step sends them)."""
        return self._dev[:nbytes]


class GraphSet:
    """Graphs of one forward per captured size, outputs kept per size (captured largest first,
    all in one memory pool), and the padding of a batch to the captured size that replays it.
    Subclasses define _forward(bs); `_warm_up` and `_record` say what runs eagerly before a
    size's capture and what the capture records (by default: _forward, its outputs kept)."""

    what = "graphs"

    def _init_graphs(self, sizes: list[int], capture: bool, pool=None) -> None:
        """pool: a CUDA graph memory pool to capture into (the decode graphs'): one replay runs
        at a time on the one stream, and no graph's output is another's scratch memory (outputs
        stay referenced, or were allocated before capture), so the graphs may share it."""
        self.sizes = sizes
        self.pool = pool
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}
        self.num_replays = 0
        self.replays_by_size: dict[int, int] = {}
        if capture and sizes:
            self._capture_all()

    def _forward(self, bs: int):
        raise NotImplementedError

    def _warm_up(self, bs: int) -> None:
        """Eagerly before the bs capture: cuBLAS picks its kernels and workspaces, the decode
        attention sizes its merge counters."""
        self._forward(bs)

    def _record(self, bs: int) -> None:
        """What the bs graph records (inside the capture)."""
        self.outputs[bs] = self._forward(bs)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # Kept: graphs built later may be captured into the same pool.
        self.pool = pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        for bs in startup.progress(list(reversed(self.sizes)), f"capturing {self.what}"):
            self._warm_up(bs)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._record(bs)
            self.graphs[bs] = g
        torch.cuda.synchronize()
        logger.info("captured %s for batch sizes %s", self.what, self.sizes)

    def _replay(self, bs: int) -> None:
        self.graphs[bs].replay()
        self.num_replays += 1
        self.replays_by_size[bs] = self.replays_by_size.get(bs, 0) + 1

    def can_run(self, num_seqs: int) -> bool:
        return padded_size(self.sizes, num_seqs) is not None

    def padded_size(self, num_seqs: int) -> int:
        bs = padded_size(self.sizes, num_seqs)
        if bs is None:
            raise ValueError(f"no captured size for {num_seqs} sequences (sizes {self.sizes})")
        return bs
