"""The request fields each endpoint understands. Anything else is a 400 naming it: a client that
sends an option we do not implement (a newer OpenAI field, a vLLM extension we lack) must learn
that it had no effect, not get an answer that silently ignored it (OpenAI answers unknown
arguments the same way)."""

from __future__ import annotations

from voltserve.services.gateway.errors import bad_request

# Both endpoints: sampling, stopping, logprobs, streaming, structured outputs (OpenAI names and
# vLLM's extensions). `user` is an opaque end-user label with no effect on generation.
_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "logit_bias",
        "seed",
        "stop",
        "stop_token_ids",
        "skip_special_tokens",
        "logprobs",
        "prompt_logprobs",
        "return_tokens_as_token_ids",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "user",
    }
)

CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    # OpenAI's stored completions: `metadata` is an opaque label like `user`; `store` is
    # accepted only as false (nothing is stored here).
    "metadata",
    "store",
}

# suffix and best_of are known so that their own checks can say what is supported of them.
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


def refuse_unknown(obj: dict, known: frozenset[str], where: str = "") -> None:
    """400 naming the first key of `obj` not in `known`; `where` prefixes the name of a nested
    object's keys ("input[2]" gives "input[2].foo")."""
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        name = f"{where}.{unknown[0]}" if where else unknown[0]
        raise bad_request(
            f"unrecognized request argument {name!r}: this server does not support it"
            + (f" (also unrecognized: {unknown[1:]})" if len(unknown) > 1 else ""),
            name,
        )


def check_fields(body: dict, kind: str) -> None:
    """400 for the first field `kind` ("chat" | "completion") does not understand."""
    refuse_unknown(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    if body.get("store"):
        raise bad_request("store is not supported: this server keeps no completions", "store")
    # The opaque labels have no effect here, but a malformed one is still the client's error
    # (OpenAI's types: a string, and string keys to string values).
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"user must be a string, got {type(user).__name__}", "user")
    meta = body.get("metadata")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise bad_request("metadata must be an object of string values", "metadata")


# Content-part / block types that carry media, in the three APIs' spellings -> what they carry.
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "input_audio": "audio",
    "video_url": "video",
    "file": "file",
    "input_file": "file",
    "document": "file",
}


def media_note(kind: object) -> str:
    """What a refusal of a media content part adds (empty for any other type): the server
    serves text only, a vision-language model's text part included."""
    what = _MEDIA_PARTS.get(kind) if isinstance(kind, str) else None
    if what is None:
        return ""
    return (
        f" ({what} inputs are not supported: only text is served, also for a vision-language "
        "model such as Qwen3.5)"
    )
