"""Acceptance of proposed tokens, exact in distribution.

The verify step samples the target's token at every proposed position: row j of a request with
drafts d_0..d_{m-1} holds the target's logits after the context plus d_0..d_{j-1}, and the
sampler draws t_j from them exactly as a non-speculative step at that output position would
(same bias, penalties over the prefix, min_tokens mask, temperature/top-k/top-p/min-p, and the
Gumbel noise of (seed, output position, token id)). Acceptance keeps t_0.. while t_j == d_j and
ends with the first t_j that differs (or with t_m, the bonus token, when all m match).

Why this is rejection sampling: a deterministic proposal is a point mass q = 1[d_j]. Standard
speculative sampling accepts d_j with probability min(1, p(d_j)/q(d_j)) = p(d_j) and otherwise
samples from normalise(max(0, p - q)) = p restricted to tokens != d_j. Drawing t_j ~ p and
accepting iff t_j == d_j does exactly that: P(accept) = p(d_j), and on a rejection t_j is p
conditioned on t_j != d_j. It is one particular coupling of the two draws, the one that reuses
the target's own seeded draw, so the emitted tokens are not only distributed as the target's:
they are the very tokens a non-speculative run with the same seed samples, token for token
(greedy is the temperature-0 case). Failover resume, which replays (seed, position), stays exact.
"""

from __future__ import annotations


def num_accepted(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's tokens (targets has len(drafts) + 1)."""
    n = 0
    for d, t in zip(drafts, targets):
        if d != t:
            break
        n += 1
    return n
