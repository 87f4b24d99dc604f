"""LLMEngine: requests in, one batched model step at a time, token deltas out.

The engine owns the request table, the batcher (which decides each step) and the model runner
(which computes it). It is driven by one thread: add_request / abort_request / step are not
thread-safe, by design (the executor service feeds them from a queue on the engine thread).

Length policy: a request whose prompt (+ tokens already generated, on failover) leaves no room
for one more token within max_model_len is rejected. Otherwise it is accepted and max_tokens is
clamped in effect: generation stops with finish_reason "length" at max_tokens or when the
sequence reaches max_model_len, whichever comes first (vLLM's engine behaves the same; the
renderer rejects prompt + max_tokens > max_model_len up front for the HTTP API).

max_model_len is also capped at what the KV cache can hold (num_kv_blocks * block_size), so one
request alone always fits and preemption can always make progress.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

from voltserve.services.executor.batcher import Batcher
from voltserve.services.executor.block_manager import BlockManager
from voltserve.services.executor.nonfinite import (
    NONFINITE_STATUS,
    NONFINITE_TYPE,
    nonfinite_message,
)
from voltserve.services.executor.request import (
    Request,
    RequestOutput,
    RequestStatus,
    RunnerOutput,
    SampledIds,
    SampledToken,
    StepPlan,
)
from voltserve.services.executor.spec.acceptance import num_accepted
from voltserve.services.executor.state_cache import StateSlots
from voltserve.shared.config import EngineConfig
from voltserve.shared.model_limits import ModelLimits
from voltserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Engine-drawn seeds stay in the non-negative int64 range the sampler takes.
_SEED_BITS = 63


def stop_reason(req: Request, token: int) -> str | None:
    """The stop rule, after `token` was appended to the request's output: "stop" on a stop or
    EOS token (unless ignore_eos; not before min_tokens) or when its grammar has terminated,
    "length" at max_tokens or the context limit (Request.max_output_tokens), else None."""
    n = len(req.output_token_ids)
    if token in req.stop_token_set and n >= req.params.min_tokens:
        return "stop"
    if n >= req.max_output_tokens:
        return "length"
    g = req.grammar
    if g is not None and g.terminated:
        return "stop"
    return None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # 0..1, blocks referenced by some request
    num_preemptions_total: int
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens served from the prefix cache
    prompt_tokens_total: int  # prompt tokens of requests that got their first token
    generation_tokens_total: int  # tokens generated (several per step under speculation)
    # Speculation (vLLM's spec_decode counters): verify steps of a request with proposals,
    # proposed tokens verified, of them accepted, accepted per proposal position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Tokens per verify step (accepted + the target's own), over all verify steps so far.
    spec_decode_mean_acceptance_length: float = 0.0
    # Requests ended with an error because their logits were not finite (NaN or infinity).
    nonfinite_requests_total: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, runner=None, grammar_pool=None):
        """grammar_pool: a GrammarCompilerPool (grammar.py) for structured outputs; None: one
        is made on the first structured request, from the model folder's tokenizer."""
        if runner is None:
            from voltserve.services.executor.model_runner import ModelRunner

            runner = ModelRunner(config)
        self.config = config
        self.runner = runner
        self.block_size = runner.block_size
        self.vocab_size = runner.vocab_size
        self.eos_token_ids = list(runner.eos_token_ids)
        capacity = runner.num_kv_blocks * runner.block_size
        self.max_model_len = runner.max_model_len
        if capacity < self.max_model_len:
            logger.warning(
                "KV cache holds %d tokens (%d blocks), fewer than max_model_len %d: "
                "capping max_model_len at %d",
                capacity,
                runner.num_kv_blocks,
                self.max_model_len,
                capacity,
            )
            self.max_model_len = capacity
        # Linear-attention models (state_cache.py): a state slot per running request, and no
        # prefix caching (a cached KV prefix would skip the tokens that build the state).
        state_cache = getattr(runner, "state_cache", None)
        slots = None if state_cache is None else StateSlots(state_cache.num_slots)
        prefix_caching = config.enable_prefix_caching is not False and state_cache is None
        if state_cache is not None and config.enable_prefix_caching:
            raise ValueError(
                "--enable-prefix-caching is not supported with "
                f"{getattr(runner.arch, 'architecture', 'this model')}: its linear-attention "
                "state is not cached with the KV blocks (leave the flag out)"
            )
        self.block_manager = BlockManager(
            runner.num_kv_blocks, runner.block_size, prefix_caching, slots
        )
        # A pipelined runner launches step N+1 before step N's tokens are back: one slot of
        # lookahead keeps its block allocated at block boundaries.
        self._pipeline = getattr(runner, "pipeline", None)
        self.batcher = Batcher(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            lookahead_slots=1 if self._pipeline is not None else 0,
        )
        self.proposer = None
        self.spec_config = None
        if config.speculative_config is not None:
            from voltserve.services.executor.spec.proposer import make_proposer

            self.spec_config = config.speculative_config
            # The runner built it at start-up (with its model, KV cache and graphs, if any); a
            # runner without a model (tests) leaves it to the engine.
            self.proposer = runner.proposer or make_proposer(self.spec_config)
            self.proposer.bind(self.block_manager)
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted_per_pos = [0] * k
        self.requests: dict[str, Request] = {}  # unfinished requests only
        self._seed_rng = random.Random(config.seed)
        self._prompt_tokens_total = 0
        self._awaiting_first_token: set[str] = set()
        self._generation_tokens_total = 0
        self._generate_calls = 0
        # Structured outputs: requests whose grammar is compiling (off this thread) wait here,
        # outside the batcher, and join its waiting queue once compiled; nothing else waits.
        self._grammar_pool = grammar_pool
        self._compiling: dict[str, tuple[Request, Future]] = {}
        self._nonfinite_total = 0
        self._nonfinite_message = nonfinite_message(str(getattr(runner, "dtype", "")))

    def limits(self) -> ModelLimits:
        """What this engine enforces, decided here once (the runner's context after the sliding
        window cap, then the KV capacity cap above): published in the executor's status hash,
        read by the gateway and the renderer."""
        return ModelLimits(self.max_model_len, tuple(self.eos_token_ids), self.vocab_size)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        output_token_ids: Sequence[int] | None = None,
        arrival_time: float | None = None,
        validated: bool = False,
    ) -> None:
        """Queue a request. output_token_ids (failover resume): tokens already generated; they
        are recomputed as context and sampling continues at output position len(output).
        validated: the caller's edge already ran params.validate() (the gateway, for every
        request that comes through the services); in-process callers leave it False."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        output = list(output_token_ids or [])
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if not validated:
            params.validate()
        for name, ids in (("prompt", prompt), ("output_token_ids", output)):
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                raise ValueError(
                    f"request {request_id!r}: {name} token id {bad} is outside the "
                    f"vocabulary [0, {self.vocab_size})"
                )
        # Like vLLM: a bias on a token the model does not have is an error, not a silent no-op.
        bad_bias = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad_bias:
            raise ValueError(
                f"request {request_id!r}: logit_bias token ids {sorted(bad_bias)} are outside "
                f"the vocabulary [0, {self.vocab_size})"
            )
        bad_after = [t for t in params.structured_after or () if t >= self.vocab_size]
        if bad_after:
            raise ValueError(
                f"request {request_id!r}: structured_after token ids {bad_after} are outside "
                f"the vocabulary [0, {self.vocab_size})"
            )
        num_tokens = len(prompt) + len(output)
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {num_tokens} tokens, which leaves no "
                f"room to generate within max_model_len {self.max_model_len}"
            )
        if len(output) >= params.max_tokens:
            raise ValueError(
                f"request {request_id!r}: {len(output)} output tokens already given, "
                f"max_tokens is {params.max_tokens}: nothing left to generate"
            )
        if not params.eos_token_ids and self.eos_token_ids:
            # The sampler (min_tokens) and the stop check both read the request's own list.
            params = dataclasses.replace(params, eos_token_ids=list(self.eos_token_ids))
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(_SEED_BITS)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            seed=seed,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            output_token_ids=output,
        )
        # What stop_reason reads, derived once (params do not change after this point).
        request.stop_token_set = frozenset(params.stop_token_ids) | frozenset(
            () if params.ignore_eos else params.eos_token_ids
        )
        request.max_output_tokens = min(params.max_tokens, self.max_model_len - len(prompt))
        self.requests[request_id] = request
        self._awaiting_first_token.add(request_id)
        if params.structured is not None:
            self._compiling[request_id] = (request, self._grammars().submit(params.structured))
            return
        self.batcher.add(request)

    # ---- structured outputs ------------------------------------------------------------------

    def _grammars(self):
        if self._grammar_pool is None:
            from voltserve.services.executor.grammar import GrammarCompilerPool

            self._grammar_pool = GrammarCompilerPool(
                self.config.model, self.vocab_size, self.eos_token_ids
            )
        return self._grammar_pool

    def _admit_compiled(self, wait: float = 0.0) -> list[RequestOutput]:
        """Requests whose grammar finished compiling join the batcher; those whose grammar
        failed end with an error. wait: seconds to block for one to finish (nothing else to
        do)."""
        if wait > 0:
            futures.wait(
                [f for _, f in self._compiling.values()],
                timeout=wait,
                return_when=futures.FIRST_COMPLETED,
            )
        errors: list[RequestOutput] = []
        for rid, (req, fut) in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            try:
                from voltserve.services.executor.grammar_state import GrammarState

                state = GrammarState(
                    fut.result(),
                    req.stop_token_set,
                    req.params.structured_after,
                    utf8=self._grammars().utf8_table(),
                )
                bad = state.catch_up(req.output_token_ids)
                if bad is not None:
                    raise ValueError(
                        f"output token {bad} ({req.output_token_ids[bad]}) given with the "
                        "request does not follow its structured output constraint"
                    )
            except Exception as e:  # noqa: BLE001 - any failure ends this request, not the engine
                logger.warning("request %s: structured output constraint failed: %s", rid, e)
                err = self._error_output(req, f"{e}", 400)
                err.error_param = "response_format"
                errors.append(err)
                continue
            req.grammar = state
            self.batcher.add(req)
        return errors

    def _error_output(self, req: Request, message: str, status: int) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        self._awaiting_first_token.discard(req.request_id)
        out = RequestOutput(
            req.request_id,
            [],
            None,
            "error",
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )
        out.error, out.error_status = message, status
        return out

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Finish the given requests now and free their blocks. Unknown or finished ids are
        ignored (aborts are idempotent: they may arrive twice or after the finish)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if self._compiling.pop(rid, None) is not None:
                req.status = RequestStatus.FINISHED  # never reached the batcher
                req.finish_reason = "abort"
            else:
                self.batcher.abort(req)
            self._awaiting_first_token.discard(rid)
            outputs.append(
                RequestOutput(
                    rid,
                    [],
                    None,
                    "abort",
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batched step; return a delta for every request that got a token or ended."""
        # While a pipelined decode step is in flight, admitting a request would discard it
        # (decode_pipeline.py): admit on the step after, which launches nothing ahead.
        pipeline = self._pipeline
        early = self._admit_compiled() if self._compiling else None
        if self.proposer is not None:
            self._propose()
        plan = self.batcher.schedule(admit=pipeline is None or pipeline.may_admit())
        if not plan.scheduled:
            if early:
                return early
            if self._compiling:
                # Only grammars being compiled: wait a little for one instead of spinning.
                return self._admit_compiled(wait=0.005)
            if self.requests and not self.batcher.running:
                # Cannot happen with max_model_len capped at the KV capacity; be loud if it does.
                raise RuntimeError(
                    f"{len(self.batcher.waiting)} requests wait but none can be scheduled "
                    f"({self.block_manager.num_free_blocks} free blocks)"
                )
            return []
        out = self.runner.execute(plan)
        if self.proposer is not None:
            self.proposer.observe(out)
        return self._postprocess(plan, out, early or [])

    def _postprocess(
        self, plan: StepPlan, out: RunnerOutput, outputs: list[RequestOutput]
    ) -> list[RequestOutput]:
        """The step's results applied to its requests: computed positions advance, each sampling
        request's tokens are emitted under the stop rule (stop_reason) and, for a verify row
        group, speculative acceptance; finished requests leave. Appends to and returns outputs:
        a delta for every request that got a token or ended."""
        if out.prompt_logprobs:
            self._store_prompt_logprobs(out.prompt_logprobs)
        sampled = out.sampled
        # The sampler's greedy fast path hands back bare ids: no SampledToken per row.
        ids = sampled.token_ids if type(sampled) is SampledIds else None
        append = outputs.append
        any_finished = False
        i = 0
        bs = self.block_size
        cache_full_blocks = self.block_manager.cache_full_blocks
        awaiting = self._awaiting_first_token
        # Runs for every scheduled request every step: plain arithmetic and attributes derived
        # at admission instead of properties and per-step re-derivation.
        num_generated = 0
        for s in plan.scheduled:
            req = s.request
            spec = s.spec_token_ids
            if spec:
                # A verify row group: the target's tokens after the last known token and after
                # each proposal; kept while they equal the proposals (spec/acceptance.py).
                m = len(spec)
                if ids is not None:
                    targets, toks = ids[i : i + m + 1], None
                else:
                    toks = sampled[i : i + m + 1]
                    targets = [t.token_id for t in toks]
                i += m + 1
                n_acc = num_accepted(list(spec), targets)
                self._spec_drafts += 1
                self._spec_draft_tokens += m
                for j in range(n_acc):
                    self._spec_accepted_per_pos[j] += 1
                o = self._emit(req, targets[: n_acc + 1], toks, True)
            else:
                before = req.num_computed_tokens
                after = before + s.num_new_tokens
                req.num_computed_tokens = after
                if after // bs > before // bs:  # a block became full: register it for reuse
                    cache_full_blocks(req)
                if after != len(req.prompt_token_ids) + len(req.output_token_ids):
                    continue  # a prefill chunk that does not reach the end: nothing sampled
                if ids is not None:
                    o = self._emit(req, (ids[i],), None, False)
                else:
                    o = self._emit(req, (sampled[i].token_id,), sampled[i : i + 1], False)
                i += 1
            rid = req.request_id
            if rid in awaiting:  # its first token this run (a failover resume: this run's)
                awaiting.discard(rid)
                self._prompt_tokens_total += len(req.prompt_token_ids)
            num_generated += len(o.new_token_ids)
            if o.finish_reason is not None:
                any_finished = True
            append(o)
        self._generation_tokens_total += num_generated
        if i != len(sampled):
            raise RuntimeError(f"runner returned {len(sampled)} tokens for {i} sampling requests")
        if out.nonfinite_prompts and self._fail_nonfinite_prompts(
            plan.scheduled, out.nonfinite_prompts, outputs
        ):
            any_finished = True
        if any_finished:
            self.batcher.remove_finished()
        return outputs

    def _emit(self, req: Request, tokens, toks, verify: bool) -> RequestOutput:
        """Append tokens (the one sampled token, or a verify group's accepted proposals and the
        target's own) to the request's output one by one until the stop rule ends it; toks:
        their SampledTokens (None: bare ids). After a verify group, the KV of the emitted tokens
        counts as computed and the slots of the rejected proposals go back."""
        out_ids = req.output_token_ids
        p = req.params
        g = req.grammar
        reason = None
        emitted: list[int] = []
        for t in tokens:
            if t < 0:  # NONFINITE (a proposal never equals it, so it ends the accepted run)
                return self._nonfinite_failed(req, len(out_ids))
            # The matcher advances over emitted tokens only: each was drawn under the mask of
            # the grammar state after the accepted tokens before it (GrammarState.fill_draft).
            if g is not None and not g.accept(t):
                return self._grammar_failed(req, t, len(out_ids))
            out_ids.append(t)
            emitted.append(t)
            reason = stop_reason(req, t)
            if reason is not None:
                break
        if verify:
            # KV is valid for the last known token and the accepted proposals: one position
            # per emitted token (the newest emitted token is computed by the next step).
            bs = self.block_size
            before = req.num_computed_tokens
            req.num_computed_tokens = after = before + len(emitted)
            if after // bs > before // bs:
                self.block_manager.cache_full_blocks(req)
            if reason is None:
                self.block_manager.take_back(req, after + 1)
        rid = req.request_id
        if reason is not None:
            self.batcher.finish(req, reason)
            del self.requests[rid]
        logprobs = None
        if p.logprobs is not None:
            logprobs = [
                toks[j] if toks is not None else SampledToken(t) for j, t in enumerate(emitted)
            ]
        prompt_len = len(req.prompt_token_ids)
        o = RequestOutput(rid, emitted, logprobs, reason, prompt_len, req.num_cached_tokens)
        if p.prompt_logprobs is not None and len(out_ids) == len(emitted):
            # The request's first tokens: its prompt logprobs go with them.
            o.prompt_logprobs = self._prompt_logprobs_of(req)
            o.prompt_token_ids = req.prompt_token_ids
        return o

    # ---- speculation -------------------------------------------------------------------------

    def _propose(self) -> None:
        """Set spec_token_ids of every decoding request (the batcher schedules what fits)."""
        running = self.batcher.running
        dbs = self.spec_config.disable_by_batch_size
        if dbs is not None and len(running) >= dbs:
            decoding = []
        else:
            decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        # A model with linear-attention state snapshots the state of at most this many
        # verified requests a step (state_rollback.py); the others decode without proposals.
        cap = getattr(self.runner, "max_verify_seqs", None)
        if cap is not None:
            decoding = decoding[:cap]
        for r in running:
            r.spec_token_ids = []
        # Called with no request too: a proposer that collects the target's hidden states
        # (EAGLE) takes them every step, so they never pile up.
        k = self.spec_config.num_speculative_tokens
        for r, prop in zip(decoding, self.proposer.propose(decoding)):
            # At most k, whatever the proposer returned (an n-gram lookup or a custom proposer
            # may return more): the verify graphs, the step's token budget and the per-position
            # acceptance counters are sized for 1 + k tokens per request. And never more than
            # the request can still emit after this step's own token.
            room = r.max_output_tokens - len(r.output_token_ids) - 1
            prop = list(prop[: max(min(k, room), 0)])
            if prop and r.grammar is not None:
                # A constrained request: up to the first token its grammar rejects (the
                # target could never sample it under the mask).
                prop = prop[: r.grammar.valid_prefix(prop)]
            r.spec_token_ids = prop

    def _grammar_failed(self, req: Request, token: int, pos: int) -> RequestOutput:
        """The matcher rejected a token the sampler drew under the grammar's own mask: a bug
        (mask and matcher disagree). The request ends with an error instead of a wrong output."""
        logger.error(
            "request %s: the grammar matcher rejected token %d at output position %d, which "
            "its own mask allowed",
            req.request_id,
            token,
            pos,
        )
        self.batcher.finish(req, "error")
        del self.requests[req.request_id]
        return self._error_output(req, "internal error: the structured output matcher failed", 500)

    # ---- non-finite logits ---------------------------------------------------------------------

    def _nonfinite_failed(self, req: Request, pos: int) -> RequestOutput:
        """The request's logits at output position `pos` were not finite: it ends with an error
        (the rest of the batch goes on), and the KV blocks only it held are zeroed and leave
        the prefix cache."""
        self._nonfinite_total += 1
        logger.warning(
            "request %s: non-finite logits at output position %d (prompt of %d tokens); it ends "
            "with an error. VOLTSERVE_LAYER_TRACE=1 logs the first layer whose output is "
            "non-finite",
            req.request_id,
            pos,
            len(req.prompt_token_ids),
        )
        blocks = req.block_ids
        self.batcher.finish(req, "error")
        dropped = self.block_manager.forget(blocks)
        scrub = getattr(self.runner, "scrub_kv_blocks", None)
        if dropped and scrub is not None:
            scrub(dropped)
        return self._nonfinite_output(req)

    def _nonfinite_output(self, req: Request) -> RequestOutput:
        out = self._error_output(req, self._nonfinite_message, NONFINITE_STATUS)
        out.error_type = NONFINITE_TYPE
        return out

    def _fail_nonfinite_prompts(
        self, scheduled, nonfinite: set[str], outputs: list[RequestOutput]
    ) -> bool:
        """Requests of this step whose prompt-logprobs rows were not finite (the runner names
        them) end with an error instead of what they produced; True if there were any. Their
        KV is finite: a NaN in the KV would have reached their own sampled row too."""
        failed = False
        for s in scheduled:
            req = s.request
            if req.request_id not in nonfinite or req.finish_reason == "error":
                continue
            failed = True
            self._nonfinite_total += 1
            logger.warning(
                "request %s: non-finite prompt logprobs; it ends with an error", req.request_id
            )
            if req.status is not RequestStatus.FINISHED:
                self.batcher.finish(req, "error")
            req.finish_reason = "error"
            outputs[:] = [o for o in outputs if o.request_id != req.request_id]
            outputs.append(self._nonfinite_output(req))
        return failed

    def _store_prompt_logprobs(self, computed: dict[str, list[tuple[int, dict]]]) -> None:
        for rid, entries in computed.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.prompt_lp is None:
                req.prompt_lp = {}
            req.prompt_lp.update(entries)

    @staticmethod
    def _prompt_logprobs_of(req: Request) -> list[dict | None]:
        got = req.prompt_lp or {}
        n = len(req.prompt_token_ids)
        missing = [p for p in range(1, n) if p not in got]
        if missing:  # a bug if it happens: say so, and send nothing rather than a wrong number
            logger.error("%s: no prompt logprobs for positions %s", req.request_id, missing[:5])
        req.prompt_lp = None
        return [None] + [got.get(p) for p in range(1, n)]

    # ---- state -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.batcher.running),
            num_waiting=len(self.batcher.waiting) + len(self._compiling),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            num_preemptions_total=self.batcher.num_preemptions,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            spec_decode_num_drafts=self._spec_drafts,
            spec_decode_num_draft_tokens=self._spec_draft_tokens,
            spec_decode_num_accepted_tokens=sum(self._spec_accepted_per_pos),
            spec_decode_num_accepted_tokens_per_pos=tuple(self._spec_accepted_per_pos),
            spec_decode_mean_acceptance_length=(
                1.0 + sum(self._spec_accepted_per_pos) / self._spec_drafts
                if self._spec_drafts
                else 0.0
            ),
            nonfinite_requests_total=self._nonfinite_total,
        )

    # ---- convenience -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        validated: bool = False,
    ) -> list[list[int]]:
        """Run prompts to completion (tests, CLI); returns the generated token ids of each.
        Requests already queued keep running alongside; only these prompts' outputs return.
        validated: as add_request's."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        self._generate_calls += 1
        ids = [f"generate-{self._generate_calls}-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p, validated=validated)
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
        return [results[rid] for rid in ids]

    def check_all_free(self) -> bool:
        """True when no request holds a block (tests; after everything finished or aborted)."""
        return self.block_manager.all_free()


__all__ = ["EngineStats", "LLMEngine", "RequestStatus"]
