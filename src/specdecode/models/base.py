"""The model interface the engine and drafters use, and the two forwards built on it (prefill, tree verify)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..cache import KVCache
from ..errors import SpecDecodeError
from ..tree import Draft, ancestor_mask, depths, with_root


class CausalLM(ABC):
    """A causal LM that attends over a KVCache with an explicit tree mask and explicit positions."""

    name: str
    tokenizer: object  # a transformers tokenizer
    vocab_size: int  # rows of the logits
    max_context: int
    eos_token_ids: frozenset[int]
    dtype: torch.dtype

    @abstractmethod
    def new_cache(self, capacity: int) -> KVCache: ...

    @abstractmethod
    def forward(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,  # [q]
        positions: torch.Tensor,  # [q]
        tree_mask: torch.Tensor,  # [q, cache.pending + q] bool: what each new token sees of the uncommitted part
        last_only: bool = False,
        probe_embedding: torch.Tensor | None = None,  # [H]: the input of every position whose id is PROBE
    ) -> torch.Tensor:  # [q, V] float32 logits ([1, V] with last_only); the q entries stay uncommitted
        ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[q] ids -> [q, H] input embeddings, for drafters that probe in embedding space."""
        raise SpecDecodeError(f"{self.name} does not expose its input embeddings.", "Pick another drafter.")


def prefill(model: CausalLM, cache: KVCache, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Append committed tokens to the cache; return the [V] logits after the last one."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)  # [q]
    assert cache.pending == 0, "prefill needs a cache without uncommitted entries"
    q = ids.shape[0]
    positions = torch.arange(cache.length, cache.length + q)
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    logits = model.forward(cache, ids, positions, causal, last_only=True)  # [1, V]
    cache.commit_all()
    return logits[0]


def forward_tree(model: CausalLM, cache: KVCache, root_token: int, draft: Draft) -> torch.Tensor:
    """One forward over [root, draft tokens] with tree attention; returns [N+1, V] target logits, uncommitted."""
    assert cache.pending == 0
    parents = with_root(draft.parents)  # [N+1]
    ids = torch.cat([torch.tensor([root_token]), draft.tokens])  # [N+1]
    positions = cache.length + depths(parents) - 1  # [N+1], root at the next free position
    return model.forward(cache, ids, positions, ancestor_mask(parents), probe_embedding=draft.probe_embedding)


def attention_mask(cache: KVCache, q: int, tree_mask: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[q, end+q] bool over every cache entry, once the q new slots are reserved: committed entries are
    visible, the uncommitted ones as tree_mask says; with a sliding window, only keys less than `window`
    positions behind the query."""
    committed = torch.ones(q, cache.length, dtype=torch.bool)
    mask = torch.cat([committed, tree_mask], dim=1)  # [q, end+q]
    if window is not None:
        key_pos = cache.positions[: cache.end + q]
        query_pos = cache.positions[cache.end : cache.end + q]
        mask &= (query_pos[:, None] - key_pos[None, :]) < window
    return mask
