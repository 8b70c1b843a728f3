"""Stop strings over a stream of text pieces: a stop string may span any number of pieces (tokens), and the
text is never emitted past its start. Text that could be the beginning of a stop string is held back until the
next piece decides it. The text ends before the stop string that is complete first (of those complete at the
same place, the one starting first), so where the pieces split the text never changes where it ends."""

from __future__ import annotations

from collections.abc import Sequence


def partial_suffix(text: str, needles: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `needles` (0: none)."""
    longest = max((len(n) for n in needles), default=1) - 1
    for k in range(min(longest, len(text)), 0, -1):
        tail = text[-k:]
        if any(n.startswith(tail) for n in needles):
            return k
    return 0


class StopStrings:
    """push(piece) -> (text safe to emit, stopped). Once stopped, the text before the stop string has been
    emitted and nothing more is; flush() gives back what was held when the stream ends."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        text = self.held + piece
        if not self.stops:
            return text, False
        hits = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]   # (end, start)
        if hits:
            self.held = ""
            return text[:min(hits)[1]], True
        k = partial_suffix(text, self.stops)
        self.held = text[len(text) - k:]
        return text[:len(text) - k], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
