"""The proposer interface: given decoding requests, suggest up to k next tokens for each.

A proposer only suggests; the target model decides. Acceptance (spec/acceptance.py) keeps the
target's output distribution exactly, whatever is proposed, so a proposer affects speed only.
Proposals here are deterministic (a point mass q), which is what lets acceptance reuse the
target's own seeded draw (see acceptance.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from voltserve.services.executor.request import Request, RunnerOutput


class Proposer(ABC):
    # Whether the runner hands out the target's last hidden states (RunnerOutput.hidden_states).
    needs_hidden_states = False

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    def observe(self, output: RunnerOutput) -> None:
        """Every step's runner output, before the engine post-processes it and before the next
        propose() (a proposer that reads the target's hidden states keeps them here)."""
        return None  # noqa: PLR1711 (most proposers read nothing from the step)

    @abstractmethod
    def propose(self, requests: list[Request]) -> list[list[int]]:
        """Up to self.k proposed tokens per request (an empty list: none), in order. Each
        request is decoding: its next input is request.last_token_id."""


def make_proposer(config, runner=None, block_manager=None) -> Proposer:
    """The proposer a SpeculativeConfig names (a draft model or an EAGLE head runs on the
    runner's draft)."""
    if config.method == "draft_model":
        from voltserve.services.executor.spec.draft_model import DraftModelProposer

        return DraftModelProposer(config.num_speculative_tokens, runner, block_manager)
    if config.method == "eagle":
        from voltserve.services.executor.spec.eagle import EagleProposer

        return EagleProposer(config.num_speculative_tokens, runner, block_manager)
    if config.method == "ngram":
        from voltserve.services.executor.spec.ngram import NgramProposer

        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    raise ValueError(f"no proposer for method {config.method!r}")
