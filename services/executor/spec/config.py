"""--speculative-config: vLLM's JSON keys, validated into a plain dataclass."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from voltserve.services.executor.spec.registry import METHODS

# Methods vLLM knows that this build does not run yet: refused by name, never ignored.
# (eagle3: its heads fuse three target layers' hidden states and propose from a reduced draft
# vocabulary, a different checkpoint format and a second hidden-state seam.)
NOT_YET = ("eagle3", "medusa", "mlp_speculator")
# vLLM's per-architecture spellings of method "mtp": those of the families whose MTP layers this
# build runs are aliases; the others name architectures it does not run, refused by name.
MTP_ALIASES = ("qwen3_next_mtp", "qwen3_5_mtp")
MTP_NOT_SUPPORTED = ("deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "ernie_mtp", "longcat_flash_mtp")
_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # n-gram: the longest and shortest suffix of the sequence searched for in its history.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # No proposals in a step with at least this many running requests (None: always propose).
    disable_by_batch_size: int | None = None
    # draft_model: the draft checkpoint folder (same tokenizer as the target); eagle: the EAGLE
    # head's folder (spec/eagle_head.py).
    model: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(d, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {d!r}")
        method = d.get("method")
        if method is None and d.get("model"):
            method = "draft_model"  # vLLM: a draft model named without a method
        if method in MTP_ALIASES:
            method = "mtp"
        if method in MTP_NOT_SUPPORTED:
            raise ValueError(
                f"--speculative-config: method {method!r} is not supported: its architecture's "
                "MTP layers are not implemented (method 'mtp' serves the Qwen3-Next / Qwen3.5 "
                "/ 3.6 families)"
            )
        if method in NOT_YET:
            raise ValueError(
                f"--speculative-config: method {method!r} is not supported yet "
                f"(supported: {', '.join(METHODS)})"
            )
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(
                f"--speculative-config: unknown method {method!r} (supported: {', '.join(METHODS)})"
            )
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise ValueError(f"--speculative-config: unsupported keys {unknown}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(
                f"--speculative-config: num_speculative_tokens must be an integer in [1, 16], "
                f"got {k!r}"
            )
        lo = d.get("prompt_lookup_min")
        hi = d.get("prompt_lookup_max")
        # vLLM: either bound alone sets the other.
        if lo is None and hi is None:
            lo, hi = 1, 4
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(
                    f"--speculative-config: {name} must be a positive integer, got {v!r}"
                )
        if lo > hi:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min {lo} > prompt_lookup_max {hi}"
            )
        dbs = d.get("disable_by_batch_size")
        if dbs is not None and (not isinstance(dbs, int) or isinstance(dbs, bool) or dbs < 1):
            raise ValueError(
                f"--speculative-config: disable_by_batch_size must be a positive integer, "
                f"got {dbs!r}"
            )
        model = d.get("model")
        what = METHODS[method].model
        if what is not None:
            if not isinstance(model, str) or not model:
                raise ValueError(
                    f'--speculative-config: method {method!r} needs "model": the {what} folder'
                )
        elif model is not None:
            raise ValueError(f'--speculative-config: method {method!r} takes no "model"')
        return cls(method, k, lo, hi, dbs, model)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The normalized object (every bound filled in): from_dict(to_dict()) is self."""
        d: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
        }
        if self.disable_by_batch_size is not None:
            d["disable_by_batch_size"] = self.disable_by_batch_size
        if self.model is not None:
            d["model"] = self.model
        return d
