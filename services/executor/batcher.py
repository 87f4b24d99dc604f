"""Continuous batching: decide, every step, which tokens of which requests to compute.

Each request carries num_computed_tokens; a step computes a contiguous run of its next tokens.
A step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Order:

1. running requests that decode (one token each, or 1 + m with m proposed tokens to verify
   under speculation), oldest first;
2. running requests still in prefill, oldest first (a chunk as large as the budget allows);
3. waiting requests, first come first served, while budget, sequences and blocks allow; a
   prompt longer than the remaining budget starts with a chunk. The first waiting request that
   does not fit stops admission, so a long prompt is never overtaken indefinitely.

There are no prefill and decode phases: chunked prefill follows from the budget.

When a running request needs a block and none is free, the newest running request is preempted:
its blocks are freed, and it goes to the front of the waiting queue to be recomputed later over
prompt + outputs so far (the prefix cache often still holds most of it). The oldest running
request is therefore never preempted unless it runs alone, and alone it always fits (the engine
caps max_model_len at the KV capacity), so the engine always makes progress.
"""

from __future__ import annotations

import logging
from collections import deque

from voltserve.services.executor.block_manager import BlockManager
from voltserve.services.executor.request import (
    Request,
    RequestStatus,
    ScheduledRequest,
    StepPlan,
)

logger = logging.getLogger(__name__)


# A prefill chunk that returns prompt logprobs computes logits for every row (vocabulary-wide,
# fp32): its size is capped so those stay a bounded fraction of the activation memory.
PROMPT_LOGPROBS_CHUNK = 1024


def _chunk_cap(req: Request) -> int:
    if req.params.prompt_logprobs is not None and not req.output_token_ids:
        return PROMPT_LOGPROBS_CHUNK
    return 1 << 62


class Batcher:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lookahead_slots: int = 0,
    ):
        """lookahead_slots: KV slots a decoding request also gets past this step's token when
        blocks are free (best effort, never by preemption), so that a step launched ahead
        (decode_pipeline.py) finds its block allocated at a block boundary."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead_slots = lookahead_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the newest is last
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self, admit: bool = True) -> StepPlan:
        """The next step's plan. admit=False leaves waiting requests waiting (the engine asks
        so while the runner has a decode step in flight that a prefill would discard)."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        # Insertion order = plan order: decodes are scheduled first, so they come first.
        scheduled: dict[str, ScheduledRequest] = {}
        preempted = False

        def preempt_newest() -> Request:
            """Preempt the newest running request; undo its share of this step if it had one."""
            nonlocal budget, preempted
            victim = self.running.pop()
            s = scheduled.pop(victim.request_id, None)
            if s is not None:
                budget += s.num_new_tokens
            self._preempt(victim)
            preempted = True
            return victim

        def grow(req: Request, num_new: int) -> bool:
            """Find blocks for num_new more tokens, preempting newer requests; False if req
            itself had to go."""
            while not bm.append_slots(req, num_new):
                if preempt_newest() is req:
                    return False
            return True

        # 1. Running decodes, oldest first. This loop runs for every request every step, so it
        # avoids property calls and only asks the block manager when a block boundary is
        # crossed. A list copy, since preemption shrinks self.running.
        bs = bm.block_size
        ahead = self.lookahead_slots
        prefills: list[Request] = []
        mixed = False  # something besides one-token decodes was scheduled
        for req in list(self.running):
            if budget == 0:
                break
            if preempted and req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            done = req.num_computed_tokens
            if len(req.prompt_token_ids) + len(req.output_token_ids) - done != 1:
                prefills.append(req)
                continue
            if done < len(req.block_ids) * bs or grow(req, 1):
                spec = req.spec_token_ids
                if spec:
                    # Speculation, best effort: as many proposed tokens as the budget, the
                    # output limit (a verify step yields up to len(spec) + 1 tokens) and the
                    # free blocks allow; never a preemption for them.
                    m = min(
                        len(spec),
                        budget - 1,
                        req.max_output_tokens - len(req.output_token_ids) - 1,
                    )
                    if m > 0 and bm.append_slots(req, 1 + m):
                        scheduled[req.request_id] = ScheduledRequest(req, 1 + m, spec[:m])
                        budget -= 1 + m
                        mixed = True
                        continue
                scheduled[req.request_id] = ScheduledRequest(req, 1)
                budget -= 1
                # The lookahead only for a request that will decode again after this step.
                if (
                    ahead
                    and done + 1 + ahead > len(req.block_ids) * bs
                    and len(req.output_token_ids) + 1 < req.max_output_tokens
                ):
                    bm.append_slots(req, 1 + ahead)  # False (no free block): no lookahead

        # 2. Running prefill chunks, oldest first (including recomputation after preemption).
        for req in prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, _chunk_cap(req))
            if grow(req, num_new):
                scheduled[req.request_id] = ScheduledRequest(req, num_new)
                budget -= num_new
                mixed = True

        # 3. Waiting requests, FCFS. Not after a preemption: blocks are short right now.
        while (
            admit
            and self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            cached = bm.match_prefix(req)
            num_cached = len(cached) * bm.block_size
            num_new = min(req.num_tokens - num_cached, budget, _chunk_cap(req))
            if not bm.allocate(req, cached, num_new):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if not req.num_preemptions:
                # Reported prompt tokens served from the cache (vLLM: set at first admission).
                # A re-admission after preemption also hits the request's own generated tokens.
                req.num_cached_tokens = min(num_cached, len(req.prompt_token_ids))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest(req, num_new)
            budget -= num_new
            mixed = True

        plan = list(scheduled.values())
        # Only the decode loop scheduled anything: every row is a one-token decode that samples.
        decode_only = None if mixed else True
        pending = not admit and bool(self.waiting) and len(self.running) < self.max_num_seqs
        return StepPlan(plan, self.max_num_batched_tokens - budget, decode_only, pending)

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req, finished=False)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug(
            "preempted %s at %d tokens (%d free blocks)",
            req.request_id,
            req.num_tokens,
            self.block_manager.num_free_blocks,
        )

    # ---- after a step ------------------------------------------------------------------------

    def finish(self, request: Request, reason: str) -> None:
        """Mark a request finished and free its blocks. The caller drops finished requests from
        self.running with remove_finished() once per step, not one list scan per request."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.block_manager.free(request, finished=True)

    def remove_finished(self) -> None:
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def abort(self, request: Request) -> None:
        """Finish a request wherever it is (waiting, mid-prefill, decoding); frees its blocks."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.finish(request, "abort")
