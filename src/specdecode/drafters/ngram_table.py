"""An n-gram table: the last `key` tokens -> recent continuations, least recently seen dropped first."""

from __future__ import annotations

from collections import OrderedDict


class NgramTable:
    def __init__(self, key_lengths: tuple[int, ...] = (2, 1), length: int = 4, per_key: int = 8):
        self.key_lengths = key_lengths  # longest first: a longer key is a more specific match
        self.length = length  # tokens per continuation
        self.per_key = per_key
        self.tables: dict[int, dict[tuple, OrderedDict]] = {n: {} for n in key_lengths}
        self.indexed = 0  # tokens of the current sequence whose full-length continuations are indexed

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams of `tokens` (a sequence that only grows) not indexed yet."""
        last_start = len(tokens) - self.length  # continuations must be complete
        for start in range(max(self.indexed, 1), last_start + 1):
            continuation = tuple(tokens[start : start + self.length])
            for n in self.key_lengths:
                if start >= n:
                    self._add(n, tuple(tokens[start - n : start]), continuation)
        self.indexed = max(self.indexed, last_start + 1)

    def add_sequence(self, tokens: list[int]) -> None:
        """Index a finished sequence (a document, an earlier answer, a harvested n-gram) in full; the
        incremental indexing of the sequence `extend` follows is left where it was."""
        indexed, self.indexed = self.indexed, 0
        self.extend(tokens)
        self.indexed = indexed

    def lookup(self, context: list[int], limit: int) -> list[list[int]]:
        """Up to `limit` continuations of the context's end, most specific key and most recent first."""
        found: list[list[int]] = []
        for n in self.key_lengths:
            bucket = self.tables[n].get(tuple(context[-n:]))
            for continuation in reversed(bucket or {}):
                if list(continuation) not in found:
                    found.append(list(continuation))
                    if len(found) == limit:
                        return found
        return found

    def _add(self, n: int, key: tuple, continuation: tuple) -> None:
        bucket = self.tables[n].setdefault(key, OrderedDict())
        bucket.pop(continuation, None)
        bucket[continuation] = None
        if len(bucket) > self.per_key:
            bucket.popitem(last=False)
