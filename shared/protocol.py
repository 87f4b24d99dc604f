"""Wire messages between the services, defined once. Each is a plain dataclass; on the wire it is
a msgpack map of its fields plus "t", the message type. Token ids travel as lists of ints.

Streams (see docs/architecture.md):
  vs:render          RenderRequest                     gateway  -> renderer (group)
  vs:render:large    RenderRequest (large, or grammar) gateway  -> renderer (group)
  vs:sched           EngineRequest | AbortRequest      renderer/gateway -> scheduler (group)
  vs:exec:{id}       EngineRequest | AbortRequest      scheduler -> executor (group)
  vs:gw:{id}         StepOutput | RequestError         executor/renderer/scheduler -> gateway
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgpack


@dataclass
class RenderRequest:
    request_id: str
    gateway_id: str
    kind: str  # "chat" | "completion"
    # chat: OpenAI messages; completion: a string or a list of token ids.
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams.to_dict()
    n: int = 1  # the renderer fans out n EngineRequests "{request_id}.{i}"
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    arrival_time: float = 0.0
    # False when the client gave no max_tokens: the renderer lowers sampling["max_tokens"] to the
    # context left after the prompt instead of rejecting the request (vLLM's behaviour).
    max_tokens_explicit: bool = True


@dataclass
class EngineRequest:
    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams.to_dict(); seed always set by the renderer
    arrival_time: float = 0.0
    # Failover: tokens already streamed to the client. The executor recomputes them as context
    # and continues at output position len(output_token_ids) with the remaining budget.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class AbortRequest:
    request_ids: list[str]
    reason: str = "abort"


@dataclass
class TokenLogprob:
    logprob: float
    top: list[list[Any]] | None = None  # [[token_id, logprob], ...]


@dataclass
class RequestDelta:
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]
    # Index in the output of token_ids[0]; lets receivers drop repeats after failover/redelivery.
    output_offset: int
    logprobs: list[dict[str, Any]] | None = None  # TokenLogprob as dicts, one per token
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Only on a request's first delta, when its sampling asked for prompt_logprobs: the prompt's
    # token ids and one entry per prompt token (None for the first, which has no context):
    # {"logprob": float, "rank": int (1 = most likely), "top": [[token_id, logprob], ...]}.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


@dataclass
class StepOutput:
    executor_id: str
    step: int
    deltas: list[RequestDelta]


@dataclass
class RequestError:
    """A request that ended with an error before or instead of producing tokens."""

    request_id: str
    status: int  # HTTP status the gateway answers with
    message: str
    type: str = "invalid_request_error"
    param: str | None = None


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (RenderRequest, EngineRequest, AbortRequest, StepOutput, RequestError)
}


def encode(msg: Any) -> bytes:
    if type(msg) is StepOutput:
        # The hot message (one per gateway per engine step, a delta per running request):
        # asdict's recursive deep copy costs microseconds per delta, and every field is plain
        # data already. Same map, same key order, same bytes.
        d = {
            "executor_id": msg.executor_id,
            "step": msg.step,
            "deltas": [x.__dict__ for x in msg.deltas],
        }
    else:
        # Every other message holds plain data only (no nested dataclasses): a shallow copy of
        # its fields is the map asdict would build, without asdict's element-by-element deep
        # copy (milliseconds for a 1K-token prompt, paid per hop).
        d = dict(msg.__dict__)
    d["t"] = type(msg).__name__
    return msgpack.packb(d, use_bin_type=True)


def decode(data: bytes) -> Any:
    """Bytes -> message dataclass. Raises ValueError on anything malformed."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        cls = MESSAGE_TYPES[d.pop("t")]
    except Exception as e:  # noqa: BLE001 - any decoding failure is the same error to callers
        raise ValueError(f"malformed message: {e}") from e
    if cls is StepOutput:
        d["deltas"] = [RequestDelta(**x) for x in d["deltas"]]
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
