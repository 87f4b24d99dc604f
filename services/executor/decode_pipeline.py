"""Pipelined graph decode: step N+1 is launched before step N's ids reach the host.

A decode step keeps the GPU busy 5-20 ms (Llama-3-8B, H200, batch 1-256) while the host's share
of a step (the engine's bookkeeping, staging, the graph launch, the copy back: 0.3-1 ms) would
leave it idle. So after replaying step N the runner launches step N+1 for the same requests as
if each continues: positions + 1 staged on the host, the input ids copied on the device from
step N's in-graph argmax. Then it waits for step N's ids.

The engine's next plan uses that step when its requests are all among the ones launched, at
the launched positions, one token each: requests that finished (or were aborted or preempted)
in between are rows whose work is dropped, and the rest keep their ids; the step after is
launched from the device ids of the kept rows. A plan with anything else (a new request's
prefill, a chunk) discards it, which costs one step of GPU time, so the engine avoids making
one: while a step is in flight the batcher does not admit (StepPlan.admit_pending says it held
back), and then the pipeline launches nothing ahead, so the plan after admits without a discard.
A new request waits at most one decode step longer for its first token.

Dropping rows and discarding are safe because the stream orders everything: a launched step
only wrote the KV slot one past each of its requests' positions, inside blocks those requests
still held when it was launched (never a full block, so never one the prefix cache shares), and
whatever later reuses those blocks runs after it. The pipeline runs only where the step's tokens
are the plain argmax (greedy, no logprobs, penalties, bias or min_tokens ban), for batches up to
VOLTSERVE_PIPELINE_MAX_BATCH (default: every graph size). At a block boundary it continues only
when the block is already there: the engine gives a pipelined runner's batcher one slot of
lookahead (batcher.py), so a decoding request holds the next block one step early whenever a
block is free.

On by default (VOLTSERVE_PIPELINE_DECODE=0 turns it off). Checked against the eager engine on the
CPU emulation of the graphs (tests/engine/test_decode_pipeline.py) and on the GPU
(tests/gpu/test_cuda_graph_decode.py). What it saves is in BENCHMARKS.md (§1 and §2: a few
percent of a step at batch 1 and 256).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from voltserve.services.executor.request import Request, RequestStatus, SampledIds, StepPlan
from voltserve.services.executor.sampler import plain_argmax_step

if TYPE_CHECKING:
    from voltserve.services.executor.model_runner import ModelRunner

PIPELINE_ENV = "VOLTSERVE_PIPELINE_DECODE"
MAX_BATCH_ENV = "VOLTSERVE_PIPELINE_MAX_BATCH"
DEFAULT_MAX_BATCH = 1 << 30  # no cap: every decode graph size


def pipeline_enabled() -> bool:
    return os.environ.get(PIPELINE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def pipeline_max_batch() -> int:
    """The largest batch the pipeline launches ahead (VOLTSERVE_PIPELINE_MAX_BATCH)."""
    raw = os.environ.get(MAX_BATCH_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BATCH
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_BATCH_ENV} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{MAX_BATCH_ENV} must be a positive integer, got {raw!r}")
    return value


@dataclass
class _InFlight:
    """A replayed step whose ids are being copied back, or the kept rows of one."""

    reqs: list[Request]
    positions: list[int]  # the position each row computes
    ids_host: torch.Tensor  # pinned [B launched] int64 the ids land in
    ids_dev: torch.Tensor  # the launched step's argmax ids on the device
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU: already there)
    rows: list[int] | None = None  # the launched rows these requests are (None: the first B)

    def wait_ids(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        if self.rows is None:
            return self.ids_host[: len(self.reqs)].tolist()
        ids = self.ids_host.tolist()
        return [ids[r] for r in self.rows]

    def device_ids(self) -> torch.Tensor:
        """These rows' ids on the device (the next step's input ids), in request order."""
        if self.rows is None:
            return self.ids_dev[: len(self.reqs)]
        idx = torch.tensor(self.rows, dtype=torch.int64)
        if self.ids_dev.is_cuda:
            # Pinned, from the caching host allocator: it keeps the block until the copy is done.
            idx = idx.pin_memory()
        return self.ids_dev.index_select(0, idx.to(self.ids_dev.device, non_blocking=True))


class DecodePipeline:
    def __init__(self, runner: ModelRunner, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        self.runner = runner
        self.max_batch = max_batch
        n = runner.graphs.sizes[-1]
        pin = runner.device.type == "cuda"
        # Two landing buffers: the step being read and the step launched ahead of it.
        self._bufs = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._next_buf = 0
        self.ahead: _InFlight | None = None
        self.launched = 0  # steps launched ahead (for tests and the log)
        self.used = 0  # of those, steps the engine's plan used (in full or some rows)
        self.dropped_rows = 0  # rows of used steps whose requests had left the batch

    def execute(self, plan: StepPlan) -> SampledIds | None:
        """The tokens of a decode-only graph step, launching the next one ahead where it can;
        None when this step is not for the pipeline (the caller runs it as usual)."""
        reqs = [s.request for s in plan.scheduled]
        current = self._take(plan, reqs)
        if current is None:
            if len(reqs) > self.max_batch or not plain_argmax_step(reqs):
                return None
            positions = [r.num_computed_tokens for r in reqs]
            current = self._launch(reqs, positions, ids_from=None)
        nxt = [p + 1 for p in current.positions]
        if not plan.admit_pending and self._can_continue(current.reqs, nxt):
            self.ahead = self._launch(current.reqs, nxt, ids_from=current)
            self.launched += 1
        return SampledIds(current.wait_ids())

    def may_admit(self) -> bool:
        """Whether the engine may admit new requests this step: not while a launched step that
        a running request can still use is in flight (a prefill would discard it). A launched
        step whose requests have all finished is dropped here: nothing can use it."""
        if self.ahead is None:
            return True
        if any(r.status is RequestStatus.RUNNING for r in self.ahead.reqs):
            return False
        self.ahead = None
        return True

    def discard(self) -> None:
        """Forget the step launched ahead (the caller runs something else next)."""
        self.ahead = None

    # ---- internals ---------------------------------------------------------------------------

    def _take(self, plan: StepPlan, reqs: list[Request]) -> _InFlight | None:
        """The step launched ahead if it covers this plan: every planned request among its
        rows at the launched position (the launched rows in order, or a subset of them)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or len(reqs) > len(ahead.reqs):
            return None
        same = len(reqs) == len(ahead.reqs)
        row_of = None
        rows: list[int] = []
        for i, s in enumerate(plan.scheduled):
            r = s.request
            if same and ahead.reqs[i] is r:
                row = i
            else:
                if row_of is None:
                    row_of = {id(x): j for j, x in enumerate(ahead.reqs)}
                row = row_of.get(id(r), -1)
                if row < 0:
                    return None
                same = False
            if s.num_new_tokens != 1 or r.num_computed_tokens != ahead.positions[row]:
                return None
            rows.append(row)
        self.used += 1
        if same:
            return ahead
        self.dropped_rows += len(ahead.reqs) - len(reqs)
        positions = [ahead.positions[j] for j in rows]
        return _InFlight(reqs, positions, ahead.ids_host, ahead.ids_dev, ahead.done, rows)

    def _can_continue(self, reqs: list[Request], positions: list[int]) -> bool:
        """Every row has its next KV slot, and some row does not end at its length limit with
        the token being sampled now (a step for rows that all end would be dropped whole)."""
        bs = self.runner.block_size
        limit = self.runner.max_model_len
        goes_on = False
        for r, p in zip(reqs, positions, strict=True):
            if p >= limit or p // bs >= len(r.block_ids):
                return False
            goes_on = goes_on or len(r.output_token_ids) + 1 < r.max_output_tokens
        return goes_on

    def _launch(
        self, reqs: list[Request], positions: list[int], ids_from: _InFlight | None
    ) -> _InFlight:
        """Stage and replay a step of `reqs` at `positions`; its input ids are the requests' last
        tokens, or (ids_from) the device-side argmax of the step launched before it."""
        runner, g = self.runner, self.runner.graphs
        B = len(reqs)
        if ids_from is None:
            ids = [r.last_token_id for r in reqs]
            runner.input_batch.stage_decode_rows(g, reqs, positions, ids)
            g.replay_staged(B)
        else:
            runner.input_batch.stage_decode_rows(g, reqs, positions, None)
            g.replay_staged(B, ids_on_device=ids_from.device_ids())
        buf = self._bufs[self._next_buf]
        self._next_buf ^= 1
        ids_dev = g.argmax_of_last(B)
        buf[:B].copy_(ids_dev, non_blocking=True)
        done = None
        if runner.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _InFlight(reqs, positions, buf[:B], ids_dev, done)
