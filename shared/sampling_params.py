"""Per-request sampling parameters, shared by the gateway (validation), the renderer and the engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from voltserve.shared.structured import check_after, check_shape

# Largest top-N logprobs a request may ask for (OpenAI allows 20 for chat).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # None: the engine draws one; randomness depends only on (seed, output position).
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Filled by the renderer from the model's generation config; not user-settable.
    eos_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs. 0: logprob of the sampled token only. N: also the top N.
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (vLLM's prompt_logprobs), computed in prefill: None: none;
    # 0: each prompt token's own logprob and rank; N: also the top N. Such a request skips the
    # prefix cache (cached tokens have no logits to read).
    prompt_logprobs: int | None = None
    # Structured output: {"type": T, "value": V} (shared/structured.py), or None.
    structured: dict[str, Any] | None = None
    # Token ids of a marker (the reasoning end, e.g. "</think>"): when set, the constraint
    # applies only to the output after the first occurrence of this sequence.
    structured_after: list[int] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise ValueError naming the offending parameter (the gateway maps it to a 400)."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids, got {tok!r}")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.structured is not None:
            check_shape(self.structured)
            if self.min_tokens:
                # A grammar may end before min_tokens, and then nothing may be sampled.
                raise ValueError(
                    "min_tokens cannot be combined with a structured output constraint"
                )
        check_after(self.structured_after)
        if self.structured_after is not None and self.structured is None:
            raise ValueError("structured_after needs a structured output constraint")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.logit_bias is not None:
            # msgpack maps with int keys are fine, but keep them explicit ints.
            d["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        p = cls(**d)
        if p.logit_bias is not None:
            p.logit_bias = {int(k): float(v) for k, v in p.logit_bias.items()}
        return p
