"""Engine-side request state and the per-step contract between the batcher and the model runner."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from voltserve.shared.sampling_params import SamplingParams

# The token id a sampler returns for a row whose logits are not all finite (NaN or infinity):
# never a vocabulary id, so the engine ends that request with an error instead of a token.
NONFINITE = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to be recomputed
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Effective seed: params.seed, or one the engine drew. Noise depends on (seed, output index).
    seed: int
    arrival_time: float
    # Tokens generated so far. A failed-over request arrives with some already generated; they
    # are recomputed like prompt tokens but count as output (penalties, positions, budget).
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Linear-attention models: the request's slot in the state cache (state_cache.py), taken
    # with its first blocks and given back with them; -1 while it holds none.
    state_slot: int = -1
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_preemptions: int = 0
    # Derived from params (which do not change once a request is queued) so that per-step code
    # reads one attribute per row instead of re-deriving them every step.
    # Sampler: greedy with no logprobs, bias or penalties (None: not computed yet).
    plain_greedy: bool | None = None
    # Engine stop check: stop_token_ids plus eos_token_ids unless ignore_eos, and the output
    # length that ends the request (max_tokens or the context limit, whichever is first).
    stop_token_set: frozenset[int] = frozenset()
    max_output_tokens: int = 0
    # Speculation: tokens a proposer suggests to follow last_token_id, set before scheduling;
    # the batcher schedules as many of them as fit (ScheduledRequest.spec_token_ids).
    spec_token_ids: list[int] = field(default_factory=list)
    # A proposer's own per-request state (the draft model: how far its KV cache has caught up).
    spec_state: object = None
    # params.prompt_logprobs: prompt position -> its entry, filled as prefill chunks run (a
    # recomputation after preemption overwrites); sent with the first sampled token.
    prompt_lp: dict[int, dict] | None = None
    # Structured output: the request's GrammarState (grammar_state.py) once its grammar is
    # compiled; None for an unconstrained request.
    grammar: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        """The newest known token: what a decode step feeds in."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed_tokens, +num_new_tokens)."""

    request: Request
    num_new_tokens: int
    # Speculation: proposed tokens computed after the last known token (they are the last
    # len(spec_token_ids) of the num_new_tokens); the step samples 1 + len of them rows.
    spec_token_ids: list[int] | tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        # A step samples a token only when it computes up to the last known token.
        r = self.request
        return (
            r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == r.num_tokens
        )


@dataclass
class StepPlan:
    """What the batcher hands the model runner for one step. Decodes come first."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # Set by a batcher that knows the answer (True: every row is a one-token decode); None:
    # is_decode_only works it out.
    decode_only: bool | None = None
    # The batcher held back waiting requests it could otherwise try to admit (schedule(admit=
    # False), while a pipelined step is in flight): nothing should be launched ahead of the
    # next plan, which admits them.
    admit_pending: bool = False

    @property
    def is_decode_only(self) -> bool:
        if self.decode_only is not None:
            return self.decode_only
        return all(s.num_new_tokens == 1 and s.samples for s in self.scheduled)


@dataclass
class SampledToken:
    token_id: int
    # Present when the request asked for logprobs: the sampled token's logprob and the top N.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class SampledIds(Sequence[SampledToken]):
    """Sampled token ids with nothing else to carry (no logprobs): what the sampler returns on
    its greedy fast path instead of one SampledToken object per row. Indexing and iteration
    still give SampledTokens; the engine reads token_ids directly."""

    __slots__ = ("token_ids",)

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [SampledToken(t) for t in self.token_ids[i]]
        return SampledToken(self.token_ids[i])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"SampledIds({self.token_ids!r})"


@dataclass
class RunnerOutput:
    """What ModelRunner.execute returns for one StepPlan: everything the step computed, for the
    engine's post-processing (engine.py) and the proposer (spec/proposer.py)."""

    # One per sampling row, in plan order: a request's one token, or a verify row group's
    # 1 + len(spec_token_ids) target tokens. A row whose logits were not finite (NaN or
    # infinity) holds NONFINITE instead of a token. SampledIds on the sampler's greedy path.
    sampled: Sequence[SampledToken] = ()
    # params.prompt_logprobs: request id -> [(prompt position, entry)] computed by this step.
    prompt_logprobs: dict[str, list[tuple[int, dict]]] = field(default_factory=dict)
    # Requests with a prompt-logprobs row of non-finite logits: they end with an error, as
    # their prompt logprobs cannot be sent.
    nonfinite_prompts: set[str] = field(default_factory=set)
    # The target's last hidden states, (request, first position, [n, hidden] rows) per request
    # in step order, when the proposer reads them (Proposer.needs_hidden_states).
    hidden_states: list[tuple[Request, int, Any]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one step produced for one request (only requests that changed appear)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledToken] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # params.prompt_logprobs, on the first token's output: one entry per prompt token (None for
    # the first): {"logprob", "rank", "top": [[token_id, logprob], ...]}.
    prompt_logprobs: list[dict | None] | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs
    # Set when the request ended with an error instead of tokens (finish_reason "error"): the
    # service sends the client a RequestError with this message and HTTP status.
    error: str | None = None
    error_status: int = 400
    # The OpenAI error type and the request field it names (None: derived from the status).
    error_type: str | None = None
    error_param: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
