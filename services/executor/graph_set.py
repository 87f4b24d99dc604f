"""The CUDA-graph abstraction the decode graphs (cuda_graphs.py) and speculation's graphs
(spec/graphs.py) share: static inputs as typed views of one device byte buffer with a pinned
host twin (one copy per step), one graph per captured batch size (captured largest first into
one memory pool), and the padding of a batch to the smallest captured size that holds it."""

from __future__ import annotations

import bisect
import functools
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
        self.fields = fields
        self.dev = self.views(self._dev)
        self.host = {k: v.numpy() for k, v in self.views(self._host).items()}

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field as a typed view of byte buffer buf (this layout)."""
        out = {}
        for name, dt, shape in self.fields:
            a = self.offsets[name]
            b = a + int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
            out[name] = buf[a:b].view(dt).view(shape)
        return out

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

    def upload_columns(self, name: str, rows: int, cols: int) -> None:
        """upload() of the bytes before field `name` and of columns [0, cols) of its rows
        [0, rows) (a 2-D field, the last one a step reads): one contiguous copy and one
        strided copy (cuMemcpy2DAsync), so a step whose rows use a few of a wide field's
        columns moves those, not the whole rows. Without the CUDA driver bindings: upload()
        of everything up to the end of those rows."""
        if self._dev is self._host:
            return
        field = self.dev[name]
        memcpy_2d = _cuda_memcpy_2d()
        if memcpy_2d is None or cols >= field.shape[1]:
            self.upload(self.end_of(name, rows))
            return
        head = self.offsets[name]
        self._dev[:head].copy_(self._host[:head], non_blocking=True)
        pitch = field.stride(0) * field.element_size()
        src = self._host.data_ptr() + head
        memcpy_2d(field.data_ptr(), src, pitch, cols * field.element_size(), rows)
        self._copy_done.record()

    def device_bytes(self, nbytes: int) -> torch.Tensor:
        """The first nbytes of the device buffer (a tensor-parallel step sends them)."""
        return self._dev[:nbytes]


@functools.cache
def _cuda_memcpy_2d():
    """A host-to-device cuMemcpy2DAsync on torch's current stream (dst, src, pitch of both,
    bytes a row, rows), from numba-cuda's CUDA driver bindings; None where they are absent.
    The driver API copies in the thread's current context, torch's."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None

    def copy(dst: int, src: int, pitch: int, width: int, rows: int) -> None:
        p = cu.CUDA_MEMCPY2D()
        p.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
        p.srcHost, p.srcPitch = src, pitch
        p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.dstDevice, p.dstPitch = dst, pitch
        p.WidthInBytes, p.Height = width, rows
        (err,) = cu.cuMemcpy2DAsync(p, torch.cuda.current_stream().cuda_stream)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpy2DAsync of {rows} x {width} bytes failed: {err}")

    return copy


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
