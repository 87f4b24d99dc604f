"""RenderRequest -> EngineRequests: chat template, tokenization, context-length check, seeds,
eos ids. Pure (no Redis) so it can be tested and reused by the gateway's /tokenize.

Context length follows vLLM: a prompt of max_model_len tokens or more is rejected; a max_tokens the
client gave that does not fit (prompt + max_tokens > max_model_len) is rejected, naming both
lengths; a max_tokens the client did not give is lowered to the remaining context.
"""

from __future__ import annotations

import functools
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voltserve.services.renderer.chat_template import ChatTemplate, TemplateError, from_tokenizer
from voltserve.shared import gguf_files
from voltserve.shared.gguf_files import is_gguf
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


def model_max_len(model: str) -> int:
    if is_gguf(model):
        return gguf_files.context_length(model)
    cfg = _read_json(Path(model) / "config.json")
    cfg = {**cfg.get("text_config", {}), **cfg}
    for key in ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    raise ValueError(f"cannot find the context length in {model}/config.json; pass --max-model-len")


def eos_token_ids(model: str, tokenizer: Any) -> list[int]:
    """generation_config.json's eos_token_id, else config.json's, else the tokenizer's (a GGUF
    file: its metadata's eos / eot ids)."""
    if is_gguf(model):
        ids = gguf_files.eos_token_ids(model)
        if ids:
            return ids
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(Path(model) / name).get("eos_token_id")
        if isinstance(eos, int):
            return [eos]
        if isinstance(eos, list) and eos:
            return [int(x) for x in eos]
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else []


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


class Renderer:
    def __init__(
        self,
        model: str,
        max_model_len: int | None = None,
        tokenizer: Any = None,
        tokenizer_path: str | None = None,
    ):
        if tokenizer is None:
            tokenizer = load_tokenizer(model, tokenizer_path)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or model_max_len(model)
        self.eos_token_ids = eos_token_ids(model, self.tokenizer)
        self.template: ChatTemplate | None = from_tokenizer(self.tokenizer)
        self.vocab_size = len(self.tokenizer)

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
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: Any) -> list[int]:
        """A completion prompt given as token ids, checked against the vocabulary (text prompts
        are tokenized a batch at a time by render_many)."""
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
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
            # The template already wrote the special tokens (bos, role markers).
            return _Staged("messages", text=text, special=False)
        if req.kind == "completion":
            prompt = req.prompt if req.prompt is not None else ""
            if isinstance(prompt, str):
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
        try:
            params.validate()
        except ValueError as e:
            raise RenderFailed(400, str(e)) from e
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
            raise RenderFailed(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n_prompt} input tokens. Please reduce the length of the {where}.",
                where,
            )
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
