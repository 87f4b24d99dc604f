"""A proposer of controlled acceptance, for tests and benchmarks: it proposes a recorded
continuation of each request (the target's own greedy output from an earlier run), each token
replaced by a wrong one with probability p. Acceptance never depends on it for correctness."""

from __future__ import annotations

import random

from voltserve.services.executor.request import Request
from voltserve.services.executor.spec.proposer import Proposer


class OracleProposer(Proposer):
    def __init__(
        self,
        num_speculative_tokens: int,
        continuations: dict[str, list[int]],
        corrupt_p: float = 0.0,
        vocab_size: int = 2,
        seed: int = 0,
    ) -> None:
        """continuations: request id -> the output tokens to propose from (by output index)."""
        super().__init__(num_speculative_tokens)
        self.continuations = continuations
        self.corrupt_p = corrupt_p
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, requests: list[Request]) -> list[list[int]]:
        out = []
        for r in requests:
            cont = self.continuations.get(r.request_id, [])
            # The next input is the newest output; proposals follow it.
            n = len(r.output_token_ids)
            prop = list(cont[n : n + self.k])
            for j, t in enumerate(prop):
                if self.rng.random() < self.corrupt_p:
                    prop[j] = (t + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
            out.append(prop)
        return out
