"""Stop strings over streamed text: nothing of a stop string ever reaches the client.

Text that might be the start of a stop string is held back until the next piece of text shows
whether it is one. When a stop string appears, only the text before it is released.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add text; return what may be sent now. After a match, `stopped` is True."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        # The stop string that completes first wins (ties: the one that starts first), so the
        # result does not depend on how the text was split into pieces.
        best: tuple[int, int] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (best is None or (i + len(s), i) < best):
                best, self.matched = (i + len(s), i), s
        if best is not None:
            hit = best[1]
            self.stopped = True
            self.held = ""
            return buf[:hit]
        keep = self._partial_suffix_len(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The stream ended without a match: release what was held."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_suffix_len(self, buf: str) -> int:
        """Longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
