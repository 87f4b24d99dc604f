"""One tensor-parallel group: its rank, its size and the three collectives the model uses
(all-reduce after a row-parallel linear and the vocabulary-parallel embedding, all-gather of the
vocabulary-parallel logits) plus the step broadcast from rank 0.

torch.distributed does the communication: NCCL on CUDA (capturable, so the decode graphs hold
the all-reduces), gloo on CPU (eager; how CI runs it)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) and symmetric-memory multicast stay off: both have hung or failed on
# the hosts this runs on, and plain ring/tree all-reduce is what the decode graphs capture.
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# An idle executor waits in the step broadcast for as long as no request comes; the default
# 30-minute collective timeout would kill an idle group. A dead peer is found by the watchdogs
# in launch.py (and by gloo's closed connection), not by this timeout.
_TIMEOUT = datetime.timedelta(days=365)


def set_tp_env() -> None:
    for k, v in TP_ENV.items():
        os.environ.setdefault(k, v)


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device

    @staticmethod
    def init(rank: int, size: int, port: int, device: torch.device) -> TPGroup:
        set_tp_env()
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=_TIMEOUT,
            **kw,
        )
        return TPGroup(rank, size, device)

    @property
    def is_nccl(self) -> bool:
        return self.device.type == "cuda"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In place: t = the sum over ranks of t."""
        dist.all_reduce(t)
        return t

    def all_gather_cols(self, t: torch.Tensor) -> torch.Tensor:
        """[N, C] per rank -> [N, size * C], rank r's columns at [r * C, (r + 1) * C)."""
        t = t.contiguous()
        n, c = t.shape
        if self.is_nccl:
            out = torch.empty((self.size * n, c), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(out, t)
            return out.view(self.size, n, c).permute(1, 0, 2).reshape(n, self.size * c)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """In place from rank 0."""
        dist.broadcast(t, src=0)
        return t

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
