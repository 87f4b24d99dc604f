"""The per-request state of linear-attention layers, beside the paged KV cache.

A Gated DeltaNet layer (models/qwen3_next.py) keeps, per request, a fixed-size state instead of
one KV entry per token: the causal conv's last kernel - 1 inputs [conv_dim, kernel - 1] (in the
model's dtype) and the recurrent state [Hv, Dk, Dv] (fp32: kernels/linear_attention/__init__.py
says why). Each such layer has two pools indexed by a request's state slot (`StateCache`, on the
runner's device); the slots are handed out by `StateSlots`, which the block manager owns, so a
slot is taken when the request is admitted (with its first KV blocks) and returned when its
blocks are freed (finish, abort, preemption).

- Slots: max_num_seqs of them, so admission (capped at max_num_seqs running requests) always
  finds one.
- Chunked prefill: a chunk that starts past position 0 continues from the state its slot holds
  (the model derives "has an initial state" from the step's query start and sequence length).
- Preemption: the slot is freed with the blocks; the request restarts from position 0, so its
  state is recomputed from scratch by its prefill (as its KV blocks are in recompute mode).
  Nothing is scrubbed: a prefill that starts at position 0 never reads the slot's old contents.
- Prefix caching is off for models with such state: a cached KV prefix would skip the tokens
  that build the state (the engine turns it off).
- Sizing: the pools' bytes (slots x per-slot bytes) are taken off the KV cache's budget.
- Speculation: the pools also hold a snapshot area past the request slots (state_rollback.py:
  the state after each verified position of up to max_verify_seqs requests), allocated and
  counted with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerStateSpec:
    """The shapes of one linear-attention layer's per-request state."""

    conv_shape: tuple[int, ...]  # [conv_dim, kernel - 1], in the model's dtype
    recurrent_shape: tuple[int, ...]  # [Hv, Dk, Dv], fp32

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        conv = elem * _numel(self.conv_shape)
        return conv + 4 * _numel(self.recurrent_shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class StateCache:
    """Per linear-attention layer (in the model's layer order), the conv-state pool
    [num_slots, conv_dim, kernel - 1] and the recurrent-state pool [num_slots, Hv, Dk, Dv]
    fp32, indexed by a request's state slot (AttentionMetadata.state_slots)."""

    def __init__(
        self,
        specs: list[LayerStateSpec],
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        snapshot_shape: tuple[int, int] = (0, 0),
    ) -> None:
        """snapshot_shape: (positions, requests) of the speculative verify snapshots (none by
        default)."""
        if num_slots < 1:
            raise ValueError(f"the state cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.snapshot_shape = snapshot_shape
        self.specs = list(specs)
        self.dtype = dtype
        rows = num_slots + snapshot_shape[0] * snapshot_shape[1]
        # Layers of one spec share one tensor per kind, [layers, rows, ...]: restoring the
        # snapshot rows into request slots (`restore`) is then one copy per kind for all of
        # them, not one per layer (a verify step of a 64-layer model would launch hundreds).
        self._stacks: list[tuple[torch.Tensor, torch.Tensor]] = []
        views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for spec in dict.fromkeys(self.specs):
            idx = [i for i, s in enumerate(self.specs) if s == spec]
            conv = torch.zeros((len(idx), rows, *spec.conv_shape), dtype=dtype, device=device)
            rec = torch.zeros(
                (len(idx), rows, *spec.recurrent_shape), dtype=torch.float32, device=device
            )
            self._stacks.append((conv, rec))
            for n, i in enumerate(idx):
                views[i] = (conv[n], rec[n])
        # Per layer, its whole pools: the request slots, then the snapshot area (what the verify
        # ops index by slot and by snapshot row).
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = [
            views[i] for i in range(len(self.specs))
        ]
        # The request slots' pools (what the kernels index by state slot).
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (conv[:num_slots], rec[:num_slots]) for conv, rec in self.rows
        ]

    def snapshot_row(self, position, request):
        """The pool row of snapshot (position, request) (rows past the request slots); ints or
        broadcasting tensors."""
        return self.num_slots + position * self.snapshot_shape[1] + request

    def snapshot_rows(self, requests: int, positions: int) -> torch.Tensor:
        """[requests, positions] int64 on the pools' device: snapshot_row(j, b) at [b, j]."""
        if requests > self.snapshot_shape[1] or positions > self.snapshot_shape[0]:
            raise ValueError(
                f"snapshot rows for {requests} requests of {positions} positions; the area "
                f"holds {self.snapshot_shape[1]} of {self.snapshot_shape[0]}"
            )
        j = torch.arange(positions, dtype=torch.int64)
        b = torch.arange(requests, dtype=torch.int64)
        return self.snapshot_row(j[None, :], b[:, None]).to(self._stacks[0][0].device)

    def restore(self, slots: list[int], rows: list[int]) -> None:
        """Every layer's state in pool rows `rows` (snapshots) copied into request slots
        `slots` (queued on the current stream)."""
        if not slots:
            return
        dst, src = torch.tensor([slots, rows], dtype=torch.int64).to(self._stacks[0][0].device)
        for stack in self._stacks:
            for t in stack:
                t.index_copy_(1, dst, t.index_select(1, src))

    @staticmethod
    def bytes_for(
        specs: list[LayerStateSpec],
        num_slots: int,
        dtype: torch.dtype,
        snapshot_shape: tuple[int, int] = (0, 0),
    ) -> int:
        rows = num_slots + snapshot_shape[0] * snapshot_shape[1]
        return rows * sum(s.bytes_per_slot(dtype) for s in specs)

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.specs, self.num_slots, self.dtype, self.snapshot_shape)


class StateSlots:
    """The free list of state slots (engine side): one slot per admitted request."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"state slots must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot (more running requests than max_num_seqs)")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if slot < 0 or slot >= self.num_slots or slot in self._free:
            raise RuntimeError(f"state slot {slot} given back twice or out of range")
        self._free.append(slot)
