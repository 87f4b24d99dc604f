"""Pipelined graph decode: step N+1 is launched before step N's ids reach the host.

A small decode batch keeps the GPU busy ~5 ms per step (Llama-3-8B, H200) while the host's share
of a step (the engine's bookkeeping, staging, the graph launch, the copy back) took 0.27 ms, during
which the GPU idled. So after replaying step N the runner launches step N+1 for the same requests
as if each continues: positions + 1 staged on the host, the input ids copied on the device from
step N's in-graph argmax. Then it waits for step N's ids. When the engine's next plan is exactly
that step, it only waits for ids already on their way; any other plan (a request finished,
joined, was preempted or aborted) discards it.

Discarding is safe because the stream orders everything: the discarded step only wrote the KV
slot one past each of its requests' positions, inside blocks those requests still held when it
was launched, and whatever the next step writes there runs after it. The cost of a discard is
one step of GPU time, so the pipeline runs only for batches up to `max_batch`
(VOLTSERVE_PIPELINE_MAX_BATCH, default 8, the sizes it was timed at) and only where the step's
tokens are the plain argmax (greedy, no logprobs, penalties, bias or min_tokens ban). At a block
boundary it continues only when the block is already there: the engine gives a pipelined
runner's batcher one slot of lookahead (batcher.py), so a decoding request holds the next block
one step early whenever a block is free.

On by default (VOLTSERVE_PIPELINE_DECODE=0 turns it off). Checked against the eager engine on the
CPU emulation of the graphs (tests/engine/test_decode_pipeline.py) and on the GPU
(tests/gpu/test_cuda_graph_decode.py). Measured on an H200 at 6371e95, Llama-3-8B batch 1: 5.21 ->
4.97 ms per token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from voltserve.services.executor.request import Request, SampledIds, StepPlan
from voltserve.services.executor.sampler import plain_argmax_step

if TYPE_CHECKING:
    from voltserve.services.executor.model_runner import ModelRunner

PIPELINE_ENV = "VOLTSERVE_PIPELINE_DECODE"
MAX_BATCH_ENV = "VOLTSERVE_PIPELINE_MAX_BATCH"
DEFAULT_MAX_BATCH = 8


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
    """A replayed step whose ids are being copied back."""

    reqs: list[Request]
    positions: list[int]  # the position each row computes
    ids_host: torch.Tensor  # pinned [B] int64 the ids land in
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU: already there)

    def wait_ids(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.ids_host[: len(self.reqs)].tolist()


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
        self.used = 0  # of those, steps the engine's plan matched

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
        if self._can_continue(current.reqs, nxt):
            self.ahead = self._launch(current.reqs, nxt, ids_from=current)
            self.launched += 1
        return SampledIds(current.wait_ids())

    def discard(self) -> None:
        """Forget the step launched ahead (the caller runs something else next)."""
        self.ahead = None

    # ---- internals ---------------------------------------------------------------------------

    def _take(self, plan: StepPlan, reqs: list[Request]) -> _InFlight | None:
        ahead, self.ahead = self.ahead, None
        if ahead is None or len(reqs) != len(ahead.reqs):
            return None
        for s, r, pos in zip(plan.scheduled, ahead.reqs, ahead.positions, strict=True):
            if s.request is not r or s.num_new_tokens != 1 or r.num_computed_tokens != pos:
                return None
        self.used += 1
        return ahead

    def _can_continue(self, reqs: list[Request], positions: list[int]) -> bool:
        bs = self.runner.block_size
        limit = self.runner.max_model_len
        for r, p in zip(reqs, positions, strict=True):
            if p >= limit or p // bs >= len(r.block_ids):
                return False
        return True

    def _launch(
        self, reqs: list[Request], positions: list[int], ids_from: _InFlight | None
    ) -> _InFlight:
        """Stage and replay a step of `reqs` at `positions`; its input ids are the requests' last
        tokens, or (ids_from) the device-side argmax of the step launched before it."""
        runner, g = self.runner, self.runner.graphs
        B = len(reqs)
        if ids_from is None:
            ids = [r.last_token_id for r in reqs]
            runner.stage_decode_rows(reqs, positions, ids)
            g.replay_staged(B)
        else:
            runner.stage_decode_rows(reqs, positions, None)
            g.replay_staged(B, ids_on_device=g.argmax_of_last(B))
        buf = self._bufs[self._next_buf]
        self._next_buf ^= 1
        buf[:B].copy_(g.argmax_of_last(B), non_blocking=True)
        done = None
        if runner.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _InFlight(reqs, positions, buf, done)
