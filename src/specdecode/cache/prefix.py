"""A prefix cache: the target's committed KV entries of earlier requests, reused by a request whose prompt begins
with the same tokens (the next turn of a chat, another question about the same document, a shared system prompt).

An entry holds copies of a KVCache's first n entries ([L, 1, H, n, D] keys and values) and the n token ids they were
computed for. The entry for tokens t[0..n) is valid for any prompt that starts with t[0..m), m <= n: an entry's
keys and values depend only on the tokens at and before it. So a lookup takes the longest common prefix of the
prompt with any entry (turn 1's prompt reused by turn 2, which adds turn 1's answer and a message; a document
prompt's first N tokens reused by another question about it), restores those entries into the request's fresh
cache, and the prefill runs only the rest: always at least the prompt's last token, whose logits the first new
token comes from. The engine stores prompts only (engine.decode says why).

Entries are evicted least recently used first once their bytes pass max_bytes (an entry larger than the bound is
not stored). Stored tensors are never written after they are stored, so a restore copies them outside the lock; the
lock guards the index only (the server's worker and API callers in other threads may share one cache).

With row-exact kernels (int4/int8 weights) an entry holds bit for bit what a prefill of its tokens computes (a
prefill's rows do not depend on how the prompt was split into forwards), so reuse changes no output. With dense
weights on torch's kernels a reused row may differ from a fresh prefill's in its last bits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .kv import KVCache


@dataclass(frozen=True)
class PrefixEntry:
    """The committed KV of `tokens`: keys and values [L, 1, H, n, D], n = len(tokens)."""

    tokens: torch.Tensor  # [n] long
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.keys.nbytes + self.values.nbytes

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def fits(self, cache: KVCache) -> bool:
        """Whether the cache holds entries of this layout and format (layers, heads, head size, dtype)."""
        ours, theirs = self.keys.shape, cache.keys.shape
        return (ours[0], ours[2], ours[4]) == (theirs[0], theirs[2], theirs[4]) and self.keys.dtype == cache.keys.dtype

    def shared(self, ids: torch.Tensor) -> int:
        """How many leading tokens of ids [m] equal this entry's."""
        n = min(len(self), ids.shape[0])
        if n == 0 or int(self.tokens[0]) != int(ids[0]):
            return 0
        differ = (self.tokens[:n] != ids[:n]).nonzero()
        return int(differ[0]) if differ.numel() else n


class PrefixCache:
    """Earlier requests' committed target KV, looked up by the longest shared token prefix; LRU within max_bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._next_key = 0
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0  # lookups that found at least one token to reuse
        self.reused_tokens = 0  # tokens those lookups reused

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int] | torch.Tensor, like: KVCache | None = None) -> tuple[int, PrefixEntry | None]:
        """(n, entry): the most leading tokens of ids that an entry holds, at most len(ids) - 1 (the last prompt token
        must run through the forward for its logits), and that entry, now the most recently used; (0, None) when
        none shares a token. With `like`, only entries that fit that cache count (a model whose KV format changed
        since they were stored cannot use them)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        limit = ids.shape[0] - 1
        with self._lock:
            best, best_key = 0, None
            for key, entry in self._entries.items():
                if like is not None and not entry.fits(like):
                    continue
                n = min(entry.shared(ids), limit)
                if n > best:
                    best, best_key = n, key
            if best_key is None:
                return 0, None
            self._entries.move_to_end(best_key)
            self.hits += 1
            self.reused_tokens += best
            return best, self._entries[best_key]

    @staticmethod
    def restore(entry: PrefixEntry, n: int, cache: KVCache) -> None:
        """Fill an empty cache with the entry's first n entries, committed, at positions 0..n-1."""
        assert cache.end == 0, "restore needs an empty cache"
        assert 0 < n <= len(entry) and n <= cache.capacity
        assert entry.fits(cache), "the entry holds another model's or another format's keys and values"
        cache.keys[:, :, :, :n] = entry.keys[:, :, :, :n]
        cache.values[:, :, :, :n] = entry.values[:, :, :, :n]
        cache.positions[:n] = torch.arange(n)
        cache.length = cache.end = n

    def store(self, ids: list[int], cache: KVCache) -> bool:
        """Keep copies of the cache's committed entries of tokens ids (len(ids) <= cache.length), unless an entry
        already holds these tokens (then it is only marked used) or they take more than max_bytes. Entries whose
        tokens are a prefix of ids are dropped: the new one serves every lookup they would. True when stored."""
        n = len(ids)
        assert n <= cache.length, "only committed entries can be stored"
        if n == 0 or self._entry_bytes(cache, n) > self.max_bytes:
            return False
        tokens = torch.tensor(ids, dtype=torch.long)
        if self._touch_covering(tokens):
            return False
        entry = PrefixEntry(tokens, cache.keys[:, :, :, :n].clone(), cache.values[:, :, :, :n].clone())
        with self._lock:
            for key in [key for key, old in self._entries.items() if old.shared(tokens) == len(old)]:
                self._drop(key)
            self._entries[self._next_key] = entry
            self._next_key += 1
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "reused_tokens": self.reused_tokens}

    def _touch_covering(self, tokens: torch.Tensor) -> bool:
        """Mark used an entry that already holds these tokens (and maybe more); False when none does."""
        with self._lock:
            for key, entry in self._entries.items():
                if entry.shared(tokens) == tokens.shape[0]:
                    self._entries.move_to_end(key)
                    return True
        return False

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    @staticmethod
    def _entry_bytes(cache: KVCache, n: int) -> int:
        L, _, H, _, D = cache.keys.shape
        return 2 * L * H * n * D * cache.keys.element_size() + 8 * n
