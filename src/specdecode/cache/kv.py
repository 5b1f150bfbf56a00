"""A preallocated KV cache written by position: truncation is O(1) and a tree keeps its accepted path in place.

Entries [0, length) are committed: the context, at positions 0..length-1. A forward writes its new entries after
the uncommitted ones (entries [length, end)) without committing them; the engine then commits the entries of the
accepted path with keep(), or drops them with discard(). A draft model expanding a tree level by level keeps its
earlier levels uncommitted until it is done.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype):
        shape = (n_layers, 1, n_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)  # [L, 1, H, C, D]
        self.values = torch.zeros(shape, dtype=dtype)  # [L, 1, H, C, D]
        self.positions = torch.zeros(capacity, dtype=torch.long)  # [C] position id of every entry
        self.capacity = capacity
        self.length = 0  # committed entries
        self.end = 0  # committed + uncommitted entries

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
        self.keys[layer, :, :, self.end : self.end + q] = new_keys
        self.values[layer, :, :, self.end : self.end + q] = new_values
        return self.keys[layer, :, :, : self.end + q], self.values[layer, :, :, : self.end + q]

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
