"""The speculative methods this build runs: --speculative-config's "method" -> its proposer.

Adding a proposer: a module in spec/ with a Proposer subclass (spec/proposer.py), and one line
here. The runner and the engine reach it only through the Proposer interface: the runner calls
its start-up hooks (its own model, KV cache and CUDA graphs, if any) and the engine its
per-step ones.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from voltserve.services.executor.spec.proposer import Proposer


@dataclass(frozen=True)
class Method:
    # "module:Class" of the proposer, the module relative to this package (or a class).
    proposer: str | type
    # What the method's "model" key names (None: the method takes no "model").
    model: str | None = None

    def proposer_class(self) -> type[Proposer]:
        if not isinstance(self.proposer, str):
            return self.proposer
        module, name = self.proposer.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)


METHODS: dict[str, Method] = {
    "ngram": Method("ngram:NgramProposer"),
    "draft_model": Method("draft_model:DraftModelProposer", "draft checkpoint"),
    "eagle": Method("eagle:EagleProposer", "EAGLE head checkpoint"),
    # The target checkpoint's own MTP layers (Qwen3-Next / Qwen3.5 / 3.6).
    "mtp": Method("mtp:MtpProposer"),
}
