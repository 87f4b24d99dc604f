"""n-gram (prompt lookup) proposer: the sequence's last n tokens, searched for in its own
history, predict what follows them.

For n from prompt_lookup_max down to prompt_lookup_min, the most recent earlier occurrence of
the last n tokens wins, and the up to k tokens after it are proposed. Copy-heavy outputs
(summaries, code edits, quoting) repeat long runs of the prompt, which this finds for free.
"""

from __future__ import annotations

import numpy as np
from voltserve.services.executor.request import Request
from voltserve.services.executor.spec.proposer import Proposer


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of tokens' longest suffix of
    length n_min..n_max; [] when none occurs."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n :]
        # Windows starting at i < L - n (an occurrence that ends before the suffix does).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, n_min: int, n_max: int) -> None:
        super().__init__(num_speculative_tokens)
        self.n_min, self.n_max = n_min, n_max

    @classmethod
    def from_config(cls, config) -> NgramProposer:
        return cls(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose(self, requests: list[Request]) -> list[list[int]]:
        out = []
        for r in requests:
            toks = np.asarray(r.prompt_token_ids + r.output_token_ids, dtype=np.int64)
            out.append(ngram_lookup(toks, self.k, self.n_min, self.n_max))
        return out
