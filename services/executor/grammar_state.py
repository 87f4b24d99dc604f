"""One request's structured-output state: its xgrammar matcher, advanced with every output token.

The matcher holds the grammar's position after the request's output so far; the engine calls
`accept` with each sampled token, the sampler asks `fill` for the next token's mask. With
`structured_after` (the reasoning end marker's token ids) the matcher stays idle until that
sequence has appeared in the output, and constrains only what follows it.

Speculative decoding: `fill_draft` fills the masks of a proposal's k+1 positions (accepting the
draft tokens one by one, then rolling them back), and `rollback` takes back tokens the target
rejected; both keep `position` (output tokens seen) in step with the request's output.

A matcher that rejects a token the sampler drew under its own mask is a bug (the mask and the
matcher disagree): `accept` returns False and the engine ends the request with an error.

With a Utf8Table (utf8_guard.py) the constrained output also stays valid UTF-8: `fill` ANDs the
tokens allowed after the output's bytes so far into the grammar's mask, and `accept` refuses a
token that would break a character, as the matcher refuses one the grammar does not allow.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from voltserve.services.executor.utf8_guard import BOUNDARY, REJECT, Utf8Table

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(
        self,
        compiled,
        stop_token_ids: Sequence[int],
        after: Sequence[int] | None = None,
        utf8: Utf8Table | None = None,
    ) -> None:
        import xgrammar as xgr

        # The request's own stop set ends the grammar: once the constraint is complete only these
        # may follow, and the engine's stop check finishes the request on them.
        self.matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=sorted(set(stop_token_ids)) or None
        )
        self.after = tuple(after) if after else None
        self.tokens: list[int] = []  # the output tokens seen, in order
        # Output index of the first constrained token (None: the marker has not appeared yet).
        self.start: int | None = None if self.after else 0
        self.utf8 = utf8
        # The UTF-8 state before each constrained token and after the last (rolled back with
        # the matcher).
        self.u8 = [BOUNDARY]

    @property
    def position(self) -> int:
        return len(self.tokens)

    @property
    def active(self) -> bool:
        return self.start is not None

    @property
    def terminated(self) -> bool:
        return self.start is not None and self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one output token. False: the matcher rejected it (nothing changes)."""
        if self.start is None:
            self.tokens.append(token)
            a = self.after
            if len(self.tokens) >= len(a) and tuple(self.tokens[-len(a) :]) == a:
                self.start = len(self.tokens)
            return True
        nxt = BOUNDARY
        if self.utf8 is not None:
            nxt = self.utf8.advance(self.u8[-1], token)
            if nxt == REJECT:
                return False
        if not self.matcher.accept_token(token):
            return False
        self.u8.append(nxt)
        self.tokens.append(token)
        return True

    def catch_up(self, tokens: Sequence[int]) -> int | None:
        """Accept tokens already generated (a failed-over request); the index of the first one
        rejected, or None."""
        for i, t in enumerate(tokens):
            if not self.accept(int(t)):
                return i
        return None

    def rollback(self, n: int) -> None:
        """Take back the last n output tokens (rejected speculative tokens)."""
        if n <= 0:
            return
        if n > len(self.tokens):
            raise ValueError(f"cannot roll back {n} of {len(self.tokens)} tokens")
        keep = len(self.tokens) - n
        if self.start is not None:
            constrained = len(self.tokens) - self.start
            undo = min(n, constrained)
            if undo:
                self.matcher.rollback(undo)
                del self.u8[-undo:]
            if keep < self.start:
                # Back before the marker ended: the constraint is not active any more.
                self.matcher.reset()
                self.start = None
                self.u8 = [BOUNDARY]
        del self.tokens[keep:]

    def fill(self, bitmask: np.ndarray, row: int) -> bool:
        """Write the next token's allowed set into bitmask[row] (int32 words, bit i of word w is
        token 32 w + i). False when the constraint is not active (the row stays as it is)."""
        if self.start is None:
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.restrict_utf8(bitmask, row)
        return True

    def restrict_utf8(self, bitmask, row: int) -> None:
        """AND into bitmask[row] (the grammar's mask, filled by `fill`) the tokens that keep the
        output valid UTF-8."""
        if self.utf8 is not None and not self.utf8.restrict(bitmask, row, self.u8[-1]):
            logger.warning("no token keeps the output valid UTF-8 here: the grammar's mask alone")

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many leading draft tokens the grammar accepts in order (the engine truncates a
        proposal there, so no verify row is spent on a token the mask would forbid). Leaves the
        state as it was."""
        accepted = 0
        try:
            for t in draft:
                if not self.accept(int(t)):
                    break
                accepted += 1
                if self.terminated:  # a stop token ends the request: nothing after it counts
                    break
        finally:
            self.rollback(accepted)
        return accepted

    def fill_draft(self, draft: Sequence[int], bitmask: np.ndarray, row: int) -> int:
        """Masks for a proposal: rows row..row+k for the positions after 0..k draft tokens,
        rows past the first draft token the grammar rejects, or past one that terminates it, set
        to allow everything (the target rejects there, or the request has stopped). Leaves the
        state as it was. Returns the rows written."""
        accepted = 0
        try:
            for j in range(len(draft) + 1):
                if self.terminated:
                    # A draft stop token ended the grammar (xgrammar has no mask after it): the
                    # request stops there, so the rows after it are never sampled from.
                    bitmask[row + j : row + len(draft) + 1] = -1
                    break
                if not self.fill(bitmask, row + j):
                    bitmask[row + j] = -1
                if j == len(draft):
                    break
                if not self.accept(int(draft[j])):
                    bitmask[row + j + 1 : row + len(draft) + 1] = -1
                    break
                accepted += 1
        finally:
            self.rollback(accepted)
        return len(draft) + 1


def restrict_utf8_rows(bitmask, states: Sequence[GrammarState]) -> None:
    """restrict_utf8 for states[i] on bitmask[i], every i at once (after xgrammar's batch fill):
    the rows of one table in a few array operations, not a few per request."""
    by_table: dict[int, tuple[Utf8Table, list[int], list[int]]] = {}
    for row, g in enumerate(states):
        if g.utf8 is not None:
            by_table.setdefault(id(g.utf8), (g.utf8, [], []))
            _, rows, st = by_table[id(g.utf8)]
            rows.append(row)
            st.append(g.u8[-1])
    for table, rows, st in by_table.values():
        if not all(table.restrict_rows(bitmask, rows, st)):
            logger.warning("no token keeps the output valid UTF-8 here: the grammar's mask alone")
