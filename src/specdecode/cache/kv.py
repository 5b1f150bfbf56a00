"""A preallocated KV cache written by position: truncation is O(1) and a tree keeps its accepted path in place.

Entries [0, length) are committed: the context, at positions 0..length-1. A forward writes its new entries after
the uncommitted ones (entries [length, end)) without committing them; the engine then commits the entries of the
accepted path with keep(), or drops them with discard(). A draft model expanding a tree level by level keeps its
earlier levels uncommitted until it is done.

For batched forwards across requests (the server), a KVPool keeps many requests' caches in one [L, B, H, C, D]
store: each KVCache becomes a view of its slot, so a forward over consecutive slots (a KVBatch) reads and writes
every request's entries in place, with no per-step copying of caches.
"""

from __future__ import annotations

import torch

KV_CACHES = ("auto", "f32", "bf16", "int8")  # --kv-cache: auto = the model's compute dtype
KV_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
INT8_EXTRA = 8  # an int8 entry's bytes after its D codes: the float32 scale, 4 zero bytes (kernels' Q8_EXTRA)


def entry_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements one cache entry (a token's key or value for one head) takes: D, or D codes + scale for int8, whose
    entries only the native kernels write and read (kernels.quantize_entries)."""
    return head_dim + (INT8_EXTRA if dtype == torch.int8 else 0)


def as_entries(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values [..., D] as a cache of this dtype stores them."""
    if dtype != torch.int8:
        return x.to(dtype)
    from .. import kernels

    native = kernels.native()
    if native is None:
        raise RuntimeError("an int8 KV cache needs specdecode's native kernels")
    return native.quantize_entries(x.float().contiguous())


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype):
        shape = (n_layers, 1, n_kv_heads, capacity, entry_width(head_dim, dtype))
        self.keys = torch.zeros(shape, dtype=dtype)  # [L, 1, H, C, D] (int8: D + 8)
        self.values = torch.zeros(shape, dtype=dtype)  # [L, 1, H, C, D] (int8: D + 8)
        self.positions = torch.zeros(capacity, dtype=torch.long)  # [C] position id of every entry
        self.capacity = capacity
        self.length = 0  # committed entries
        self.end = 0  # committed + uncommitted entries
        self.pool: KVPool | None = None  # set while the cache lives in a pool slot
        # (sinks, window) or None: forwards then see only the first `sinks` positions and the keys less than
        # `window` positions behind each query; an approximation for readers that want cheap states of a long
        # prompt (prompt compression's scorer), never set on a cache whose forwards must be exact
        self.sliding: tuple[int, int] | None = None

    @property
    def pending(self) -> int:
        return self.end - self.length

    def reserve(self, positions: torch.Tensor) -> None:
        """Claim slots [end, end+q) for a forward over q tokens at these positions."""
        q = positions.shape[0]
        if self.end + q > self.capacity:
            raise RuntimeError(f"KV cache full: {self.end} + {q} > capacity {self.capacity}")
        self.positions[self.end : self.end + q] = positions

    def update(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        """Write one layer's [1, H, q, D] keys/values into the reserved slots; return all entries so far."""
        q = new_keys.shape[-2]
        self.keys[layer, :, :, self.end : self.end + q] = as_entries(new_keys, self.keys.dtype)
        self.values[layer, :, :, self.end : self.end + q] = as_entries(new_values, self.values.dtype)
        return self.keys[layer, :, :, : self.end + q], self.values[layer, :, :, : self.end + q]

    def layer_store(self, layer: int, q: int):
        """Where a forward over q tokens writes one layer's new entries, for kernels that write them themselves:
        keys, values [1, H, C, D], the reserved columns [1, q], and the count of keys to attend over."""
        slots = torch.arange(self.end, self.end + q)[None]
        return self.keys[layer], self.values[layer], slots, self.end + q

    def layer_keys(self, layer: int) -> torch.Tensor:
        """One layer's keys of every written entry, [H, end, D] float32 (int8 entries decoded: codes x scale), for
        code that reads attention itself (prompt compression's scores)."""
        entries = self.keys[layer, 0, :, : self.end]  # [H, end, D or D + 8]
        if entries.dtype != torch.int8:
            return entries.float()
        d = entries.shape[-1] - INT8_EXTRA
        scales = entries[..., d : d + 4].contiguous().view(torch.float32)  # [H, end, 1]
        return entries[..., :d].float() * scales

    def advance(self, q: int) -> None:
        """Mark the q reserved slots as written (uncommitted)."""
        self.end += q

    def keep(self, indices: list[int]) -> None:
        """Commit the uncommitted entries at these offsets (in order, e.g. a root-to-leaf path); drop the rest."""
        if indices != list(range(len(indices))):  # a prefix is already in place
            src = torch.tensor(indices, dtype=torch.long) + self.length
            dst = slice(self.length, self.length + len(indices))
            self.keys[:, :, :, dst] = self.keys.index_select(3, src)
            self.values[:, :, :, dst] = self.values.index_select(3, src)
        self.positions[self.length : self.length + len(indices)] = torch.arange(
            self.length, self.length + len(indices)
        )
        self.length += len(indices)
        self.end = self.length

    def commit_all(self) -> None:
        self.keep(list(range(self.pending)))

    def discard(self) -> None:
        self.end = self.length

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` committed entries: O(1)."""
        self.length = min(self.length, length)
        self.end = self.length

    def repeat_to(self, length: int) -> None:
        """Grow the committed entries to `length` by repeating the ones there (position ids continue): a cache for
        timing forwards after a long context, whose cost does not depend on the numbers the entries hold."""
        n = self.length
        assert self.pending == 0 and 0 < n <= length <= self.capacity, "repeat_to needs committed entries and room"
        for start in range(n, length, n):
            width = min(n, length - start)
            self.keys[:, :, :, start : start + width] = self.keys[:, :, :, :width]
            self.values[:, :, :, start : start + width] = self.values[:, :, :, :width]
        self.positions[n:length] = torch.arange(n, length)
        self.length = self.end = length

    def move_to(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy the entries (committed and not) into new [L, 1, H, C', D] storage, C' >= end, and use it from now on."""
        keys[:, :, :, : self.end] = self.keys[:, :, :, : self.end]
        values[:, :, :, : self.end] = self.values[:, :, :, : self.end]
        positions = torch.zeros(keys.shape[3], dtype=torch.long)  # [C']
        positions[: self.end] = self.positions[: self.end]
        self.keys, self.values, self.positions, self.capacity = keys, values, positions, keys.shape[3]


class KVPool:
    """Many requests' KVCaches in one [L, B, H, C, D] store; slot i holds caches[i], whose keys/values are views.

    Slots stay packed (0..n-1): releasing a cache moves the last slot's cache into the hole (one copy per finished
    request), so any run of consecutive slots is one tensor view. The store grows (doubling its slots, or to the
    longest capacity asked for) by copying the live caches once, and is freed when the last cache leaves.
    """

    def __init__(self):
        self.caches: list[KVCache] = []
        self.keys: torch.Tensor | None = None  # [L, B, H, C, D]
        self.values: torch.Tensor | None = None  # [L, B, H, C, D]

    def slot(self, cache: KVCache) -> int:
        return next(i for i, held in enumerate(self.caches) if held is cache)

    def adopt(self, cache: KVCache) -> None:
        """Move a cache into the next free slot; from now on it is a view of that slot."""
        assert cache.pool is None, "the cache is already in a pool"
        slots, capacity = (0, 0) if self.keys is None else (self.keys.shape[1], self.keys.shape[3])
        full = len(self.caches) == slots
        if full or cache.capacity > capacity:
            self._resize(cache, max(2 * slots, 1) if full else slots, max(capacity, cache.capacity))
        self.caches.append(cache)
        cache.pool = self
        self._bind(len(self.caches) - 1)

    def release(self, cache: KVCache) -> None:
        """Free the cache's slot (the cache must not be used afterwards); the last slot's cache moves into it."""
        index = self.slot(cache)
        last = self.caches.pop()
        if last is not cache:
            self.caches[index] = last
            self._bind(index)
        cache.pool = None
        if not self.caches:
            self.keys = self.values = None

    def batch(self, caches: list[KVCache], q: int) -> KVBatch | None:
        """These caches as one batch for a forward over q tokens each, if they fill consecutive slots in this
        order; None otherwise."""
        first = self.slot(caches[0])
        if self.caches[first : first + len(caches)] != caches:  # list == compares KVCaches by identity
            return None
        rows = slice(first, first + len(caches))
        return KVBatch(caches, self.keys[:, rows], self.values[:, rows], q)

    def _resize(self, like: KVCache, slots: int, capacity: int) -> None:
        n_layers, _, n_heads, _, head_dim = like.keys.shape
        shape = (n_layers, slots, n_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=like.keys.dtype)
        self.values = torch.zeros(shape, dtype=like.values.dtype)
        for index in range(len(self.caches)):
            self._bind(index)

    def _bind(self, index: int) -> None:
        self.caches[index].move_to(self.keys[:, index : index + 1], self.values[:, index : index + 1])


class KVBatch:
    """B caches in consecutive pool slots, read and written by one forward over q tokens per request.

    Row b's new entries go to [end_b, end_b + q) of its slot; a request with fewer than q tokens is padded, and its
    padding entries land past its own entries, where its mask hides them and its next forward overwrites them.
    """

    def __init__(self, caches: list[KVCache], keys: torch.Tensor, values: torch.Tensor, q: int):
        self.caches = caches
        self.keys, self.values = keys, values  # [L, B, H, C, D] views of the pool
        self.q = q
        self.ends = torch.tensor([cache.end for cache in caches])  # [B]
        self.end = int(self.ends.max())  # the longest row's entries before this forward
        self.key_count = self.end + q  # keys every row attends over (rows mask what is not theirs)

    def reserve(self, positions: torch.Tensor) -> None:
        """Claim q slots in every row ([B, q] positions, padding included)."""
        for cache, row in zip(self.caches, positions):
            cache.reserve(row)

    def update(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        """Write one layer's [B, H, q, D] keys/values after each row's end; return [B, H, key_count, D] views."""
        rows = torch.arange(len(self.caches))[:, None]  # [B, 1]
        cols = self.ends[:, None] + torch.arange(self.q)  # [B, q]
        self.keys[layer][rows, :, cols] = as_entries(new_keys, self.keys.dtype).transpose(1, 2)  # [B, q, H, D]
        self.values[layer][rows, :, cols] = as_entries(new_values, self.values.dtype).transpose(1, 2)
        return self.keys[layer, :, :, : self.key_count], self.values[layer, :, :, : self.key_count]

    def layer_store(self, layer: int, q: int):
        """KVCache.layer_store for the batch: keys, values [B, H, C, D], columns [B, q], keys to attend over."""
        slots = self.ends[:, None] + torch.arange(q)  # [B, q]
        return self.keys[layer], self.values[layer], slots, self.key_count

    def advance(self, lengths: list[int]) -> None:
        """Mark each row's own (unpadded) new entries as written, uncommitted."""
        for cache, q in zip(self.caches, lengths):
            cache.advance(q)
