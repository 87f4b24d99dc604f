"""The per-step hand-off from rank 0 to the other ranks: a fixed 16-int64 header (what kind of
step, its sizes) and then the step's flat batch as the device tensor the runner already built
(token ids, positions, slots, block tables, sequence lengths, query starts, logits rows), or for
a graph replay the graph's staged input bytes. Two broadcasts per step, no Python objects, no
Redis: the other ranks rebuild the same forward from the same bytes."""

from __future__ import annotations

import torch
from voltserve.services.executor.tp.group import TPGroup

HEADER_LEN = 16
STOP, EAGER, GRAPH = 0, 1, 2
NUM_PARTS = 8  # ids, positions, slots, tables, seq_lens, query starts, logits rows, states


class StepSync:
    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=group.device)
        self._host = torch.zeros(HEADER_LEN, dtype=torch.int64)

    def _send_header(self, values: list[int]) -> None:
        self._host.zero_()
        self._host[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self.header.copy_(self._host)
        self.group.broadcast(self.header)

    # ---- rank 0 ----------------------------------------------------------------------------

    def send_eager(
        self, flat: torch.Tensor, lengths: list[int], B: int, width: int, decode: bool, mql: int
    ) -> None:
        self._send_header([EAGER, B, width, int(decode), mql, *lengths])
        self.group.broadcast(flat)

    def send_graph(self, bs: int, staged: torch.Tensor) -> None:
        self._send_header([GRAPH, bs, staged.numel()])
        self.group.broadcast(staged)

    def send_stop(self) -> None:
        self._send_header([STOP])

    # ---- the other ranks -------------------------------------------------------------------

    def recv_header(self) -> list[int]:
        self.group.broadcast(self.header)
        return self.header.cpu().tolist()
