"""RenderRequest -> EngineRequests: chat template, tokenization, context-length check, seeds,
eos ids. Pure (no Redis) so it can be tested and reused by the gateway's /tokenize.

Context length follows vLLM: a prompt of max_model_len tokens or more is rejected; a max_tokens the
client gave that does not fit (prompt + max_tokens > max_model_len) is rejected, naming both
lengths; a max_tokens the client did not give is lowered to the remaining context. A prompt that
certainly cannot fit is rejected before it is tokenized in full (prompt_length.py).
"""

from __future__ import annotations

import functools
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voltserve.services.renderer.chat_template import ChatTemplate, TemplateError, from_tokenizer
from voltserve.services.renderer.prompt_length import (
    EARLY_COUNT_CHARS_PER_TOKEN,
    PIECE_CHARS,
    tokens_at_least,
    tokens_by_length,
)
from voltserve.services.renderer.token_span import TokenSpan, token_span
from voltserve.shared import gguf_files
from voltserve.shared.gguf_files import is_gguf
from voltserve.shared.model_limits import ModelLimits
from voltserve.shared.protocol import EngineRequest, RenderRequest, RequestError
from voltserve.shared.sampling_params import SamplingParams
from voltserve.shared.structured import ConstraintError, check_shape, to_grammar

SEED_MASK = (1 << 63) - 1


def load_tokenizer(model: str, tokenizer: str | None = None) -> Any:
    """The tokenizer folder `tokenizer` when given, else the model's: its folder, or the
    tokenizer a GGUF file carries in its metadata."""
    from transformers import AutoTokenizer

    if tokenizer is None and is_gguf(model):
        return gguf_files.load_tokenizer(model)
    return AutoTokenizer.from_pretrained(tokenizer or model)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def position_limit(model: str) -> int:
    """The longest context the model itself allows (config.json's max_position_embeddings, a
    GGUF file's context length): an upper bound of any executor's max_model_len, for sizing
    buffers before an executor has published its limits (the gateway's default body limit and
    its token-count histograms). The context a request is held to is ModelLimits.max_model_len.
    """
    if is_gguf(model):
        return gguf_files.context_length(model)
    cfg = _read_json(Path(model) / "config.json")
    cfg = {**cfg.get("text_config", {}), **cfg}
    for key in ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    raise ValueError(f"cannot find the context length in {model}/config.json")


@dataclass
class _Staged:
    """One request of a batch between its prompt and its token ids."""

    where: str  # the request field errors name: "prompt" or "messages"
    ids: list[int] | None = None
    text: str = ""
    special: bool = True  # add the tokenizer's special tokens when encoding text
    error: Exception | None = None


class RenderFailed(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def context_error(limit: int, n_prompt: int, where: str, at_least: bool = False) -> RenderFailed:
    """vLLM's message for a prompt of `limit` tokens or more (`at_least`: counted until past the
    limit, not to its end)."""
    has = f"at least {n_prompt}" if at_least else str(n_prompt)
    return RenderFailed(
        400,
        f"This model's maximum context length is {limit} tokens. However, your request has "
        f"{has} input tokens. Please reduce the length of the {where}.",
        where,
    )


class LimitsUnknown(RenderFailed):
    """No executor has published its limits yet (the model is still starting)."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "the model is not ready yet: no executor has published its limits (context length, "
            "eos ids, vocabulary); retry once GET /health answers 200",
        )


class Renderer:
    """limits: what the executors enforce (shared/model_limits.py), set by whoever follows
    their status (the renderer and gateway services); None until one has published, and then
    every length, eos or vocabulary check raises LimitsUnknown (a 503)."""

    def __init__(
        self,
        model: str,
        limits: ModelLimits | None = None,
        tokenizer: Any = None,
        tokenizer_path: str | None = None,
    ):
        if tokenizer is None:
            tokenizer = load_tokenizer(model, tokenizer_path)
        self.tokenizer = tokenizer
        self.limits = limits
        self.template: ChatTemplate | None = from_tokenizer(self.tokenizer)
        self.span: TokenSpan = token_span(self.tokenizer)

    def _limits(self) -> ModelLimits:
        if self.limits is None:
            raise LimitsUnknown()
        return self.limits

    @property
    def max_model_len(self) -> int:
        return self._limits().max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._limits().eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self._limits().vocab_size

    # ---- prompt -> token ids ---------------------------------------------------------------

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        if self.template is None:
            raise RenderFailed(400, "this model's tokenizer has no chat template", "messages")
        if not isinstance(messages, list) or not messages:
            raise RenderFailed(400, "messages must be a non-empty list", "messages")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RenderFailed(
                400, "chat_template_kwargs must be an object", "chat_template_kwargs"
            )
        reserved = {"messages", "add_generation_prompt"} & set(kwargs or {})
        if reserved:
            raise RenderFailed(
                400, f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs"
            )
        try:
            return self.template.render(messages, add_generation_prompt, **(kwargs or {}))
        except (TemplateError, ValueError) as e:
            raise RenderFailed(400, str(e), "messages") from e

    def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        text = self.chat_prompt(messages, add_generation_prompt, kwargs)
        # The template already wrote the special tokens (bos, role markers).
        return self.tokenize_text(text, False, "messages")

    def tokenize_text(self, text: str, add_special_tokens: bool, where: str) -> list[int]:
        """text's token ids; RenderFailed (400) when it holds max_model_len tokens or more, found
        before it is tokenized in full when it is far longer."""
        self.check_text_length(text, where)
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if len(ids) >= self.max_model_len:
            raise context_error(self.max_model_len, len(ids), where)
        return ids

    def check_text_length(self, text: str, where: str) -> None:
        """RenderFailed (400) when text certainly holds max_model_len tokens or more: by its
        character count alone, else by counting its tokens in pieces up to the limit (a text
        of at most PIECE_CHARS characters is left to the one tokenization that follows)."""
        limit = self.max_model_len
        at_least = tokens_by_length(len(text), self.span.chars_per_token)
        if at_least >= limit:
            raise context_error(limit, at_least, where, at_least=True)
        if len(text) > PIECE_CHARS:
            counted = tokens_at_least(self._count_piece, text, limit)
            if counted is not None:
                raise context_error(limit, counted, where, at_least=True)

    def check_prompt_size(self, prompt: str | list[int]) -> None:
        """The checks of a completion prompt that cost no tokenization (the gateway's, before
        the prompt travels): a list of ids as long as the context, a text too many characters
        long for it. RenderFailed (400)."""
        if isinstance(prompt, str):
            n, at_least = tokens_by_length(len(prompt), self.span.chars_per_token), True
        else:
            n, at_least = len(prompt), False
        if n >= self.max_model_len:
            raise context_error(self.max_model_len, n, "prompt", at_least)

    def worth_counting_early(self, n_chars: int) -> bool:
        """Whether a prompt of n_chars characters is so long for the context that it is most
        likely refused: the gateway then checks it (in a worker thread) before it travels."""
        return n_chars > max(PIECE_CHARS, EARLY_COUNT_CHARS_PER_TOKEN * self.max_model_len)

    def check_chat_length(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """check_text_length of the conversation as the template writes it."""
        text = self.chat_prompt(messages, add_generation_prompt, kwargs)
        self.check_text_length(text, "messages")

    def _count_piece(self, piece: str) -> int:
        return len(self.tokenizer.encode(piece, add_special_tokens=False))

    def prompt_ids(self, prompt: Any) -> list[int]:
        """A completion prompt given as token ids, checked against the vocabulary (text prompts
        are tokenized a batch at a time by render_many)."""
        if not isinstance(prompt, list):
            raise RenderFailed(400, "prompt must be a string or a list of token ids", "prompt")
        if len(prompt) >= self.max_model_len:
            # Before the checks that walk the list: its length is its token count.
            raise context_error(self.max_model_len, len(prompt), "prompt")
        if not all(isinstance(t, int) for t in prompt):
            raise RenderFailed(400, "prompt must be a string or a list of token ids", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RenderFailed(
                400, f"token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})", "prompt"
            )
        if not prompt:
            raise RenderFailed(400, "prompt must not be empty", "prompt")
        return list(prompt)

    # ---- the whole request -----------------------------------------------------------------

    def render(self, req: RenderRequest) -> list[EngineRequest]:
        """Raises RenderFailed (with the HTTP status) when the request cannot run."""
        out = self.render_many([req])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def render_many(self, reqs: list[RenderRequest]) -> list[list[EngineRequest] | Exception]:
        """render() for a batch, each request's result or its exception (RenderFailed for a
        request that cannot run) in order. The batch's text prompts (and rendered chat
        templates) are tokenized in one call per special-tokens setting: a fast tokenizer then
        encodes them on its own threads, where one `encode` per request holds the GIL."""
        staged: list[_Staged | Exception] = []
        for req in reqs:
            try:
                staged.append(self._stage(req))
            except Exception as e:  # noqa: BLE001 - reported per request, in order
                staged.append(e)
        for special in (True, False):
            todo = [
                st
                for st in staged
                if isinstance(st, _Staged) and st.ids is None and st.special == special
            ]
            if todo:
                self._encode_texts(todo, special)
        out: list[list[EngineRequest] | Exception] = []
        for req, st in zip(reqs, staged, strict=True):
            if isinstance(st, Exception):
                out.append(st)
                continue
            try:
                if st.error is not None:
                    raise st.error
                out.append(self._finish(req, st.ids or [], st.where))
            except Exception as e:  # noqa: BLE001 - reported per request, in order
                out.append(e)
        return out

    def _stage(self, req: RenderRequest) -> _Staged:
        """The prompt as token ids, or as the text still to tokenize."""
        if req.kind == "chat":
            text = self.chat_prompt(
                req.messages or [], req.add_generation_prompt, req.chat_template_kwargs
            )
            self.check_text_length(text, "messages")
            # The template already wrote the special tokens (bos, role markers).
            return _Staged("messages", text=text, special=False)
        if req.kind == "completion":
            prompt = req.prompt if req.prompt is not None else ""
            if isinstance(prompt, str):
                self.check_text_length(prompt, "prompt")
                return _Staged("prompt", text=prompt, special=True)
            return _Staged("prompt", ids=self.prompt_ids(prompt))
        raise RenderFailed(400, f"unknown request kind {req.kind!r}")

    def _encode_texts(self, todo: list[_Staged], special: bool) -> None:
        texts = [st.text for st in todo]
        try:
            encoded = self.tokenizer(texts, add_special_tokens=special)["input_ids"]
        except Exception:  # noqa: BLE001 - one text's failure must not fail the others
            encoded = None
        for k, st in enumerate(todo):
            try:
                ids = (
                    encoded[k]
                    if encoded is not None
                    else self.tokenizer.encode(st.text, add_special_tokens=special)
                )
                st.ids = list(ids)
            except Exception as e:  # noqa: BLE001 - reported for its request
                st.error = e
                continue
            if st.where == "prompt" and not st.ids:
                st.error = RenderFailed(400, "prompt must not be empty", "prompt")

    def _finish(self, req: RenderRequest, ids: list[int], where: str) -> list[EngineRequest]:
        try:
            params = SamplingParams.from_dict(dict(req.sampling))
        except (TypeError, ValueError) as e:
            raise RenderFailed(400, f"bad sampling parameters: {e}") from e
        self.fit_context(params, len(ids), req.max_tokens_explicit, where)
        if params.structured is not None:
            check_constraint(params.structured)
        params.eos_token_ids = list(self.eos_token_ids)
        # Validated once, by the gateway; fit_context only lowers max_tokens (to at least 1)
        # and min_tokens with it, which keeps the parameters valid.
        out = []
        for i in range(max(1, req.n)):
            p = SamplingParams.from_dict(params.to_dict())
            # Every choice gets a concrete seed, so a failed-over request samples the same.
            p.seed = (params.seed + i) if params.seed is not None else secrets.randbits(63)
            out.append(
                EngineRequest(
                    request_id=f"{req.request_id}.{i}",
                    gateway_id=req.gateway_id,
                    prompt_token_ids=ids,
                    sampling=p.to_dict(),
                    arrival_time=req.arrival_time,
                )
            )
        return out

    def fit_context(
        self, params: SamplingParams, n_prompt: int, explicit: bool, where: str
    ) -> None:
        limit = self.max_model_len
        if n_prompt >= limit:
            raise context_error(limit, n_prompt, where)
        room = limit - n_prompt
        if params.max_tokens > room:
            if explicit:
                raise RenderFailed(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the {where}, "
                    f"{params.max_tokens} in the completion). Please reduce the length of the "
                    f"{where} or completion.",
                    "max_tokens",
                )
            params.max_tokens = room
            params.min_tokens = min(params.min_tokens, room)


@functools.lru_cache(maxsize=256)
def _check_cached(kind: str, value_json: str) -> str | None:
    """None when the constraint builds, else the message (cached: clients repeat schemas)."""
    try:
        to_grammar({"type": kind, "value": json.loads(value_json)})
    except ConstraintError as e:
        return str(e)
    return None


def check_constraint(c: dict[str, Any]) -> None:
    """Build the constraint's grammar with xgrammar (no vocabulary needed): an invalid schema,
    regex or grammar is a 400 here, before the request reaches an engine."""
    try:
        check_shape(c)
    except ValueError as e:
        raise RenderFailed(400, str(e), "response_format") from e
    msg = _check_cached(c["type"], json.dumps(c["value"]))
    if msg is not None:
        param = "response_format" if c["type"] in ("json", "json_object") else "structured_outputs"
        raise RenderFailed(400, msg, param)


def error_for(req: RenderRequest, e: RenderFailed) -> RequestError:
    return RequestError(
        request_id=req.request_id,
        status=e.status,
        message=e.message,
        param=e.param,
        type="internal_server_error" if e.status >= 500 else "invalid_request_error",
    )
