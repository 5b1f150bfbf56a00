"""Lookup pieces shared by the retrieval drafters: an n-gram table (the last `key` tokens -> recent continuations,
least recently seen dropped first), a suffix match over a token array, and reading a corpus file."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..errors import SpecDecodeError


def suffix_matches(tokens: np.ndarray, suffix: np.ndarray, max_n: int) -> list[np.ndarray]:
    """Occurrences of the end of `suffix` in `tokens` that have a continuation: levels[n-1] holds, ascending, every
    end e < len(tokens) with tokens[e-n:e] == suffix[-n:] (the continuation starts at e), for n = 1, 2, ... up to
    max_n or the longest n that occurs. Each level filters the one before, so all lengths cost one scan."""
    ends = np.flatnonzero(tokens[:-1] == suffix[-1]) + 1  # [M]
    levels = []
    for n in range(1, min(max_n, len(suffix)) + 1):
        if n > 1:
            ends = ends[ends >= n]
            ends = ends[tokens[ends - n] == suffix[-n]]
        if not len(ends):
            break
        levels.append(ends)
    return levels


def read_corpus(path: str, tokenizer) -> list[list[int]]:
    """Token ids of each document of a corpus file: a text file is one document; in a .jsonl file each line is one
    (the string values of its JSON object, joined by newlines)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecDecodeError(f"cannot read corpus {path}: {exc.strerror}.", "Check the path.") from None
    except UnicodeDecodeError:
        raise SpecDecodeError(f"corpus {path} is not UTF-8 text.", "Pass a text or .jsonl file.") from None
    documents = [text]
    if path.endswith(".jsonl"):
        lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        documents = ["\n".join(_strings(_json_line(path, number, line))) for number, line in lines]
    return [list(ids) for ids in tokenizer(documents)["input_ids"]] if documents else []


def _json_line(path: str, number: int, line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise SpecDecodeError(
            f"line {number} of corpus {path} is not JSON.", "Write one JSON value per line, or pass a text file."
        ) from None


def _strings(value) -> list[str]:
    """Every string in a JSON value, in document order."""
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [s for item in items for s in _strings(item)]


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
