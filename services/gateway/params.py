"""OpenAI request bodies -> a GenerationSpec, with 400s that name the parameter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from voltserve.services.gateway.errors import bad_request
from voltserve.services.gateway.request_fields import check_fields, media_note
from voltserve.services.gateway.structured import parse_structured
from voltserve.services.renderer.render import context_error
from voltserve.shared.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 128
MAX_STOP_STRINGS = 16
# Each stop string is matched against the held-back text on every delta (quadratic in its length).
MAX_STOP_CHARS = 256
# Token-id lists a request hands to every engine step of each of its choices.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
# OpenAI's completions API allows logprobs up to 5; we allow what the engine allows.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class GenerationSpec:
    kind: str  # "chat" | "completion"
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    max_tokens_explicit: bool = True
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    # Completions: the prompt's text (and, with logprobs, its tokens) comes first in the output.
    echo: bool = False
    # max_tokens 0 (with echo): the engine runs one step for the prompt's logprobs, the token it
    # samples is not returned.
    discard_output: bool = False
    return_tokens_as_token_ids: bool = False
    continuous_usage_stats: bool = False


def _get(
    body: dict, name: str, types: tuple[type, ...], default: Any, param: str | None = None
) -> Any:
    """body[name] checked against types; null or absent gives the default (as in vLLM).

    Lenient only where the meaning is unambiguous, as vLLM's pydantic models are: an integral
    float for an integer (2.0), 0/1 for a boolean. Strings are never numbers or booleans."""
    v = body.get(name)
    if v is None:
        return default
    param = param or name
    if bool in types and not isinstance(v, bool) and type(v) is int and v in (0, 1):
        return bool(v)
    # bool is an int in Python; never accept it for a number.
    if isinstance(v, bool) and bool not in types:
        raise bad_request(f"{name} must be of type {_names(types)}, got a boolean", param)
    if int in types and float not in types and isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, types):
        raise bad_request(f"{name} must be of type {_names(types)}, got {type(v).__name__}", param)
    # Every integer travels as msgpack int64 and every number as a float: bound them here.
    if type(v) is int and not INT64_MIN <= v <= INT64_MAX:
        raise bad_request(f"{name} is out of range (64-bit integer), got {v}", param)
    return v


# For the small endpoints (/tokenize) that check single fields the same way.
get = _get


def _names(types: tuple[type, ...]) -> str:
    return " or ".join(
        {
            int: "integer",
            float: "number",
            str: "string",
            bool: "boolean",
            list: "array",
            dict: "object",
        }.get(t, t.__name__)
        for t in types
    )


NUM = (int, float)


def _common(body: dict, kind: str, vocab_size: int) -> GenerationSpec:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    p = SamplingParams()
    p.temperature = float(_get(body, "temperature", NUM, 1.0))
    p.top_p = float(_get(body, "top_p", NUM, 1.0))
    p.top_k = _get(body, "top_k", (int,), 0)
    p.min_p = float(_get(body, "min_p", NUM, 0.0))
    p.presence_penalty = float(_get(body, "presence_penalty", NUM, 0.0))
    p.frequency_penalty = float(_get(body, "frequency_penalty", NUM, 0.0))
    p.repetition_penalty = float(_get(body, "repetition_penalty", NUM, 1.0))
    p.min_tokens = _get(body, "min_tokens", (int,), 0)
    p.ignore_eos = _get(body, "ignore_eos", (bool,), False)
    seed = _get(body, "seed", (int,), None)
    if seed is not None and not INT64_MIN <= seed <= INT64_MAX:
        raise bad_request(f"seed must fit in 64 bits, got {seed}", "seed")
    p.seed = seed
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(
            f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}",
            "stop_token_ids",
        )
    if not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in stop_ids
    ):
        raise bad_request(
            f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids"
        )
    p.stop_token_ids = list(stop_ids)
    bias = _get(body, "logit_bias", (dict,), None)
    if bias and len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias"
        )
    if bias:
        parsed = {}
        for k, v in bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise bad_request(
                    f"logit_bias keys must be token ids, got {k!r}", "logit_bias"
                ) from None
            if not 0 <= tok < vocab_size:
                raise bad_request(
                    f"logit_bias token id {tok} is out of the vocabulary [0, {vocab_size})",
                    "logit_bias",
                )
            if isinstance(v, bool) or not isinstance(v, NUM):
                raise bad_request(f"logit_bias values must be numbers, got {v!r}", "logit_bias")
            parsed[tok] = float(v)
        p.logit_bias = parsed

    spec = GenerationSpec(kind=kind, params=p)
    spec.n = _get(body, "n", (int,), 1)
    if not 1 <= spec.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {spec.n}", "n")
    spec.stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), None)
    if opts is not None:
        if not spec.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        spec.include_usage = _get(opts, "include_usage", (bool,), False, "stream_options")
        spec.continuous_usage_stats = _get(
            opts, "continuous_usage_stats", (bool,), False, "stream_options"
        )
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise bad_request(
            f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop"
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad_request(
            f"each stop string may be at most {MAX_STOP_CHARS} characters long, got {longest}",
            "stop",
        )
    spec.stop = [s for s in stop if s]
    spec.skip_special_tokens = _get(body, "skip_special_tokens", (bool,), True)
    spec.return_tokens_as_token_ids = _get(body, "return_tokens_as_token_ids", (bool,), False)
    plp = _get(body, "prompt_logprobs", (int,), None)
    if plp is not None:
        if not 0 <= plp <= MAX_LOGPROBS:
            raise bad_request(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {plp}", "prompt_logprobs"
            )
        p.prompt_logprobs = plp
    # Structured outputs (response_format, structured_outputs, guided_*): services/gateway/
    # structured.py; the renderer validates the grammar itself.
    p.structured = parse_structured(body)
    return spec


def _max_tokens(
    body: dict, spec: GenerationSpec, names: tuple[str, ...], default: int, allow_zero=False
) -> None:
    for name in names:
        v = _get(body, name, (int,), None)
        if v is not None:
            if v == 0 and allow_zero:
                spec.params.max_tokens, spec.discard_output = 1, True
                spec.max_tokens_explicit = True
                return
            if v < 1:
                raise bad_request(f"{name} must be at least 1, got {v}", name)
            spec.params.max_tokens = v
            spec.max_tokens_explicit = True
            return
    spec.params.max_tokens = default
    spec.max_tokens_explicit = False


def _validate(spec: GenerationSpec) -> GenerationSpec:
    try:
        spec.params.validate()
    except ValueError as e:
        msg = str(e)
        raise bad_request(msg, msg.split(" ", 1)[0]) from e
    return spec


def parse_chat(body: dict, vocab_size: int, max_model_len: int) -> GenerationSpec:
    spec = _common(body, "chat", vocab_size)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        _check_parts(i, m.get("content"))
    spec.messages = messages
    # Without a limit a chat answer may fill the rest of the context (the renderer clamps it).
    _max_tokens(body, spec, ("max_completion_tokens", "max_tokens"), max_model_len)
    if _get(body, "logprobs", (bool,), False):
        spec.params.logprobs = _get(body, "top_logprobs", (int,), 0)
        if not 0 <= spec.params.logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {spec.params.logprobs}",
                "top_logprobs",
            )
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    spec.add_generation_prompt = _get(body, "add_generation_prompt", (bool,), True)
    spec.chat_template_kwargs = _get(body, "chat_template_kwargs", (dict,), None)
    # tools, tool_choice and parallel_tool_calls: tools.plan_chat (it needs the server's flags).
    # Last, so that a missing or malformed required field is the error a client sees first.
    check_fields(body, "chat")
    return _validate(spec)


def _check_parts(i: int, content: Any) -> None:
    """Only text content parts are served: an image, audio or file part is refused here, by
    name, before the request travels (the renderer refuses it too)."""
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"of type {kind!r}" if isinstance(kind, str) else "not a text part"
            raise bad_request(
                f"messages[{i}].content[{j}] is {what}: only text content parts are supported"
                + media_note(kind),
                "messages",
            )


def parse_completion(
    body: dict, vocab_size: int, max_model_len: int | None = None
) -> GenerationSpec:
    spec = _common(body, "completion", vocab_size)
    prompt = body.get("prompt")
    # A batch of one is the same as one prompt.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ids_like = isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list))
    if ids_like and max_model_len is not None and len(prompt) >= max_model_len:
        # Its length is its token count: refused before the checks that walk the list.
        e = context_error(max_model_len, len(prompt), "prompt")
        raise bad_request(e.message, e.param)
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(
                f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab_size})", "prompt"
            )
    elif (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, (str, list)) for p in prompt)
    ):
        raise bad_request(
            f"batched prompts are not supported (got {len(prompt)}); send one prompt per request",
            "prompt",
        )
    else:
        raise bad_request(
            "prompt must be a non-empty string or a non-empty list of integer token ids", "prompt"
        )
    spec.prompt = prompt
    spec.echo = _get(body, "echo", (bool,), False)
    _max_tokens(body, spec, ("max_tokens",), 16, allow_zero=spec.echo)
    if _get(body, "suffix", (str,), ""):
        raise bad_request("suffix is not supported", "suffix")
    best_of = _get(body, "best_of", (int,), None)
    if best_of is not None and best_of != spec.n:
        raise bad_request(
            f"best_of is not supported (only best_of == n), got best_of={best_of}, n={spec.n}",
            "best_of",
        )
    lp = _get(body, "logprobs", (int,), None)
    if lp is not None:
        if not 0 <= lp <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {lp}", "logprobs")
        spec.params.logprobs = lp
        if spec.echo and spec.params.prompt_logprobs is None:
            # The echoed prompt's tokens carry logprobs too (computed in prefill).
            spec.params.prompt_logprobs = lp
    check_fields(body, "completion")
    return _validate(spec)
