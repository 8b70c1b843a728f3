"""Prefix reuse: snapshots of sequence state keyed by the tokens fed, so a request whose prompt starts with a prefix
the engine has just processed resumes from the snapshot instead of recomputing it.

The state of this model cannot be cut at an arbitrary position (the GDN recurrence and the PLE conv history hold
the whole past), so a snapshot covers exactly its key: the scheduler takes one when a request's prompt is done and
one when the request ends (prompt + the tokens it fed while decoding), and a new request resumes from the longest
key that is a proper prefix of its prompt (at least its last token is fed, for its logits). The backend copies
the state (`Backend.snapshot(seq)` / `Backend.restore(snap)`); the host keeps the n-gram window with it. Entries
live in an LRU bounded in bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from strata.reference.ple import NgramWindow


@dataclass(frozen=True)
class Prefix:
    tokens: tuple[int, ...]          # what the snapshot's sequence was fed
    snap: object                     # the backend's copy of the sequence state after them
    window: NgramWindow | None       # the host's n-gram window after them
    nbytes: int


class PrefixCache:
    """Snapshots by their token keys: LRU within budget_bytes; hits and tokens reused counted."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.bytes = 0
        self._lru: OrderedDict[tuple[int, ...], Prefix] = OrderedDict()
        self.hits = 0
        self.lookups = 0
        self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, tokens: tuple[int, ...]) -> bool:
        return tokens in self._lru

    def put(self, p: Prefix) -> None:
        if p.nbytes > self.budget or p.tokens in self._lru:
            return
        self._lru[p.tokens] = p
        self.bytes += p.nbytes
        while self.bytes > self.budget:
            _, old = self._lru.popitem(last=False)
            self.bytes -= old.nbytes

    def longest(self, prompt: list[int]) -> Prefix | None:
        """The entry with the longest key that is a proper prefix of prompt (made most recently used), or None."""
        self.lookups += 1
        best = None
        for key, p in self._lru.items():
            n = len(key)
            if n < len(prompt) and (best is None or n > len(best.tokens)) and tuple(prompt[:n]) == key:
                best = p
        if best is not None:
            self._lru.move_to_end(best.tokens)
            self.hits += 1
            self.tokens_reused += len(best.tokens)
        return best
