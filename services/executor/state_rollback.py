"""Speculative verify steps over linear-attention state: per-position snapshots and the commit
of the state after the last kept token.

A verify row group computes a request's last known token and its m proposals (m + 1 rows, at
positions start .. start + m). Attention layers write KV for all of them and a rejected
proposal's KV is simply overwritten later; a Gated DeltaNet's conv window and recurrent state
advanced over a rejected proposal would be wrong for every later token. So:

- Snapshots (the chosen way, not recompute): during the verify step each linear-attention
  layer walks each verify group's rows in order with the verify ops
  (kernels/linear_attention/verify.py: one launch per state kind and layer, the state read
  once) and writes the conv window [conv_dim, kernel - 1] and recurrent state [Hv, Dk, Dv]
  after each row but the last (the commit never reads that one: below) into the state cache's
  snapshot area [k, requests, ...], the state after the last row into the slot. Cost: memory
  of k x max_verify_seqs x one request's state (the Qwen3.5-27B shape: 151 MB a request and
  position), allocated with the state cache at start-up and counted in the KV sizing; a step
  verifies at most max_verify_seqs requests (the engine gives the others no proposals that
  step). An eager step (`VerifyStates`) gathers its groups into the verify ops' layout (G
  groups of the longest group's rows, the shorter ones padded at state slot -1); a verify
  graph (spec/graphs.py, up to max_verify_seqs sequences of q = k + 1 rows) has that layout
  already (`VerifyLayout`: rows past a sequence's 1 + m and padding sequences at slot -1).
  Recompute instead would need a second forward of the whole model over the kept rows (every
  layer's input depends on the layers below), which costs more than the copies.
- Commit: the engine keeps j accepted proposals and emits j + 1 tokens (the last one, the
  target's own, is computed by the next step), advancing num_computed_tokens by j + 1 (fewer
  when a stop token ends the run). The state the next step needs includes exactly the tokens
  whose KV is kept: rows 0 .. kept - 1, i.e. the snapshot after row kept - 1, kept =
  num_computed_tokens - start. The runner commits it before its next forward (`commit`: one
  copy per state kind for every request and layer, StateCache.restore): after the last row
  (all accepted) the pool holds it already; a request that finished or was
  preempted (its slot given back: state_slot no longer the one staged) is skipped, since a
  slot's next owner starts at position 0 and never reads the old contents.
- Rows of the step that are not verify groups (prefill chunks, plain decodes) run the usual
  varlen ops; their state needs no rollback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
from voltserve.services.executor.request import Request
from voltserve.services.executor.state_cache import StateCache

# Requests a verify step of a model with linear-attention state verifies at most (each has k + 1
# snapshots of its state: state_cache.py's snapshot area). Speculation pays at small batches,
# where a step is bound by the weight read; a larger batch would hold GBs of snapshots.
MAX_VERIFY_SEQS = 4


# Proposers whose verify steps the rollback serves (mtp reads the target's hidden states
# per row, which the eager forward hands out; EAGLE heads are for the Llama family).
ROLLBACK_METHODS = ("ngram", "draft_model", "mtp")


def check_spec_supported(architecture: str, method: str, tp: object | None) -> None:
    """Refuse by name what speculation on a model with linear-attention state does not do."""
    why = None
    if method not in ROLLBACK_METHODS:
        why = f"method {method!r}"
    elif tp is not None:
        why = "tensor parallelism"
    if why is not None:
        raise ValueError(
            f"--speculative-config is not supported with {architecture} and {why}: its "
            "linear-attention state is rolled back to the last accepted token without tensor "
            f"parallelism, for methods {', '.join(ROLLBACK_METHODS)}"
        )


@dataclass
class VerifyIndex:
    """VerifyStates' row selections on the device."""

    others: torch.Tensor | None  # the step's sequences that are not verify groups (None: all are)
    other_rows: torch.Tensor  # their rows
    other_lens: torch.Tensor  # their query lengths
    other_cu: torch.Tensor  # their query starts among other_rows
    # The groups in the verify ops' layout (kernels/linear_attention/verify.py), G groups of
    # Q = the longest group's rows: [G * Q] the step's row of each (g, j) (a group's first row
    # past its own rows: read, never computed), [G, Q] the row slots (-1 past a group's rows),
    # [G, Q - 1] the snapshot rows; and [rows of the groups] where each (g, j) of a group's own
    # rows sits among the G * Q and in the step.
    gather: torch.Tensor
    row_slots: torch.Tensor
    snap_rows: torch.Tensor
    live: torch.Tensor
    live_rows: torch.Tensor


@dataclass
class VerifyStates:
    """One verify step's groups (in the step's sequence order) and their snapshots: an eager
    step's (`build`) or a verify graph's (`for_graph`)."""

    seqs: list[int]  # the step's sequence index of each verify group
    first_rows: list[int]  # the group's first row in the step
    num_rows: list[int]  # 1 + its proposals
    requests: list[Request]
    slots: list[int]  # each request's state slot when staged
    starts: list[int]  # position of each group's first row (the last known token)
    query_start_loc: list[int]  # the step's, on the host
    # Per linear-attention layer, its whole pools (StateCache.rows), whose snapshot rows the
    # layer fills (an eager step's; a graph's layers have their VerifyLayout's).
    pools: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # [G, longest group - 1] the snapshot row of group g's state after its row j
    snap_rows: torch.Tensor | None = None
    _index: VerifyIndex | None = field(default=None, repr=False)

    def index(self, device: torch.device) -> VerifyIndex:
        """The step's row selections as device tensors, built once for every layer (each
        built from host lists is a copy to the device, and a layer reading the query starts
        back would wait for the GPU to drain)."""
        if self._index is None:
            qsl = self.query_start_loc
            grouped = set(self.seqs)
            others = [s for s in range(len(qsl) - 1) if s not in grouped]
            lens = [qsl[s + 1] - qsl[s] for s in others]
            cu = list(accumulate(lens, initial=0))
            rows = [r for s in others for r in range(qsl[s], qsl[s + 1])]
            Q = max(self.num_rows)
            gather, row_slots, live, live_rows = [], [], [], []
            for g, (first, n, slot) in enumerate(zip(self.first_rows, self.num_rows, self.slots)):
                gather += [first + j if j < n else first for j in range(Q)]
                row_slots.append([slot if j < n else -1 for j in range(Q)])
                live += range(g * Q, g * Q + n)
                live_rows += range(first, first + n)

            def dev(x: list) -> torch.Tensor:
                return torch.tensor(x, dtype=torch.int64, device=device)

            assert self.snap_rows is not None
            self._index = VerifyIndex(
                others=dev(others) if others else None,
                other_rows=dev(rows),
                other_lens=dev(lens),
                other_cu=dev(cu),
                gather=dev(gather),
                row_slots=dev(row_slots),
                snap_rows=self.snap_rows.to(device),
                live=dev(live),
                live_rows=dev(live_rows),
            )
        return self._index

    @classmethod
    def build(
        cls,
        cache: StateCache,
        requests: list[Request],
        spec_lens: list[int],
        query_start_loc: list[int],
        starts: list[int],
    ) -> VerifyStates | None:
        """The verify groups of an eager step (None: no request has proposals); each with
        proposals must have exactly its 1 + m verify rows scheduled."""
        g = [b for b, m in enumerate(spec_lens) if m]
        if not g:
            return None
        rows = [query_start_loc[b + 1] - query_start_loc[b] for b in g]
        for b, n in zip(g, rows):
            if n != spec_lens[b] + 1:
                raise RuntimeError(
                    f"request {requests[b].request_id}: a verify group of {n} rows for "
                    f"{spec_lens[b]} proposals (linear-attention state needs exactly 1 + m)"
                )
        v = cls(
            g,
            [query_start_loc[b] for b in g],
            rows,
            [requests[b] for b in g],
            [requests[b].state_slot for b in g],
            [starts[b] for b in g],
            list(query_start_loc),
        )
        n, G = max(rows), len(g)
        positions, seqs = cache.snapshot_shape
        if n > positions + 1 or G > seqs:
            raise RuntimeError(
                f"a verify step of {G} requests with up to {n} rows each; the state cache "
                f"snapshots {seqs} requests of {positions + 1} rows"
            )
        # The state after a group's row i is kept for i < n - 1 (the commit never reads the
        # one after a group's last row; the slot holds it).
        v.pools = cache.rows
        v.snap_rows = cache.snapshot_rows(G, n - 1)
        return v

    @classmethod
    def for_graph(
        cls,
        cache: StateCache,
        requests: list[Request],
        num_rows: list[int],
        starts: list[int],
        q: int,
    ) -> VerifyStates:
        """A verify graph's step (spec/graphs.py): sequence b is group b, its rows from b * q;
        the graph wrote its snapshots into the state cache's area, group b at request b (what
        `commit` reads: no views of it here, the graph's layers had theirs)."""
        B = len(requests)
        return cls(
            list(range(B)),
            [b * q for b in range(B)],
            list(num_rows),
            list(requests),
            [r.state_slot for r in requests],
            list(starts),
            [b * q for b in range(B + 1)],
        )

    def commit(self, cache: StateCache) -> None:
        """Put each live group's state after its last kept row into its slot (module doc):
        one copy per state kind for every group and layer."""
        slots, rows = [], []
        for i, (r, slot, start, n) in enumerate(
            zip(self.requests, self.slots, self.starts, self.num_rows)
        ):
            kept = r.num_computed_tokens - start
            if r.state_slot != slot or kept < 1 or kept >= n:
                continue  # gone (slot given back), or every row kept: the pool holds it
            slots.append(slot)
            rows.append(cache.snapshot_row(kept - 1, i))
        cache.restore(slots, rows)


@dataclass
class VerifyLayout:
    """A verify graph's rows as a linear-attention layer walks them (spec/graphs.py): B
    sequences of q rows, row b * q + j at the sequence's position start + j."""

    # [B, q] int64 (the staged rows' own layout): row (b, j)'s state slot; -1 (the verify
    # ops skip it) past the sequence's 1 + m rows and for padding sequences, so those rows never
    # advance a request's state
    row_slots: torch.Tensor
    # [B, q - 1] int64: the pool row that keeps sequence b's state after its row j
    # (StateCache.snapshot_rows)
    snap_rows: torch.Tensor
    # per linear-attention layer, its whole pools: request slots and snapshot area
    # (StateCache.rows)
    pools: list[tuple[torch.Tensor, torch.Tensor]]
