"""A smaller model with the same tokenizer drafts a chain or a tree, with its own KV cache.

The tree options (structure eagle2 | opt | sequoia, depth, topk, budget, length, threshold, min_gain, accept) are
tree_growth.py's; this file supplies the root's logits (the draft model's prefill of the context it has not seen)
and the frontier expansion: one draft forward per level over that level's expanded nodes, each attending to its
ancestors' uncommitted cache entries. Like every drafter it also takes `lookup` / `lookup_nodes` (hybrid.py).

`window=W` bounds what the draft model reads of a long context: its cache holds the context's first SINKS tokens
and its last W ones, at the positions they take in that cache (StreamingLLM's attention sinks, Xiao et al., 2023;
TriForce, Sun et al., 2024, drafts from such a partial cache). A long prompt, or a long stretch decoded while the
drafter rested or the suffix hybrid drafted, then costs the draft model W tokens instead of all of them; only the
draft changes, never the output.
"""

from __future__ import annotations

import copy
from functools import lru_cache

import torch

from ..errors import OptionError, SpecDecodeError
from ..models.base import CATCH_UP_PROMPT_ROWS, CausalLM, prefill
from ..models.native.linear import Linear
from ..sampling import SamplingParams
from ..tree import Draft
from .base import Drafter, register
from .tree_growth import TreeGrowth, TreeStrategy
from .vocabulary import VocabularyHead, frequent_tokens

SINKS = 4  # with a window: the context's first tokens the draft model always keeps (attention sinks)


@register("draft")
class DraftModelDrafter(Drafter):
    catches_up = True  # the draft model prefills the tokens decoded plainly
    sizes = {"depth": "depth", "budget": "nodes"}
    needs_draft_model = True
    variants = (
        {}, {"depth": 3, "topk": 1}, {"depth": 3, "topk": 3, "budget": 7}, {"depth": 1, "topk": 1},
        # Structures and length policies paired up, to keep the matrix short.
        {"structure": "opt", "budget": 6, "depth": 5, "min_gain": 0.05, "length": "heuristic"},
        {"structure": "sequoia", "budget": 6, "depth": 4, "length": "thompson"},
        {"topk": 1, "depth": 6, "length": "confidence", "threshold": 0.3},
        {"topk": 1, "depth": 4, "lookup": 2, "lookup_nodes": 6},
        {"topk": 2, "depth": 3, "vocab": 40},  # a draft vocabulary of 40 tokens (tiny models have 64)
        {"topk": 2, "depth": 3, "budget": 6, "window": 5, "lookup": 2},  # the window after prompts and lookups
    )
    tune_grid = (
        {"depth": 3, "topk": 1}, {"depth": 5, "topk": 1}, {"depth": 4, "topk": 2, "budget": 8},
        {"structure": "opt", "budget": 8, "depth": 6}, {"structure": "opt", "budget": 16, "depth": 8},
        {"structure": "sequoia", "budget": 8, "depth": 5}, {"structure": "sequoia", "budget": 16, "depth": 6},
        {"topk": 1, "depth": 8, "length": "confidence", "threshold": 0.4},
        {"topk": 1, "depth": 8, "length": "confidence", "threshold": 0.4, "lookup": 4},
        {"structure": "opt", "budget": 8, "depth": 8, "lookup": 4},
        {"topk": 1, "depth": 6, "lookup": 3, "lookup_nodes": 12},
    )

    def __init__(
        self, target: CausalLM, draft_model: CausalLM, structure: str = "eagle2", depth: int = 4, topk: int = 2,
        budget: int = 8, length: str = "fixed", threshold: float = 0.4, min_gain: float = 0.1,
        accept: str = "0.7,0.1,0.04,0.02", vocab: int = 0, window: int = 0,
    ):
        if window < 0:
            raise OptionError("need window >= 0 (0: the draft model reads the whole context)")
        self.tree = TreeStrategy(structure, depth, topk, budget, length, threshold, min_gain, accept)
        check_same_vocabulary(target, draft_model)
        self.model = with_draft_vocabulary(draft_model, vocab) if vocab else draft_model
        self.max_nodes = self.tree.max_nodes
        self.window = window
        self.cache = None
        self.skipped = 0  # context tokens left out of the draft model's cache, after its first SINKS

    def start(self, prompt_ids, capacity):
        self.cache = self.model.new_cache(capacity + self.tree.expanded_nodes + 1)
        self.skipped = 0

    def propose(self, context, params: SamplingParams, generator) -> Draft:
        root_logits = self._catch_up(context)  # [V]
        expansion = _CacheExpansion(self.model, self.cache, self.cache.length)
        draft = self.tree.grow(expansion, root_logits, params, generator, self.depth_limit)
        self.cache.discard()
        return draft

    def _catch_up(self, context: list[int]) -> torch.Tensor:  # [V]
        """Bring the draft model's cache up to the context (all of it, or the sinks and the window); return its
        logits after the context's last token."""
        cache = self.cache
        cache.truncate(len(context) - 1 - self.skipped)  # drop what the target did not accept; keep the rest
        start = cache.length + self.skipped  # the first context token the cache lacks
        if self.window and len(context) - start > self.window + SINKS:  # cheaper to start a new window
            if cache.length < SINKS:  # nothing is skipped before the sinks are in
                prefill(self.model, cache, context[cache.length : SINKS], prompt=False)
            cache.truncate(SINKS)
            self.skipped = len(context) - self.window - SINKS
            start = len(context) - self.window
        rest = context[start:]
        return prefill(self.model, cache, rest, prompt=len(rest) >= CATCH_UP_PROMPT_ROWS)

    def commit(self, verdict, draft, target_logits) -> None:
        self.tree.update(verdict, draft)


class _CacheExpansion:
    """Expands a frontier with one draft-model forward over its nodes; each node attends to the committed context
    and to its ancestors' entries, uncommitted in the draft model's cache. Positions count cache entries: the root
    is the last of the `committed` ones."""

    def __init__(self, model: CausalLM, cache, committed: int):
        self.model, self.cache, self.committed = model, cache, committed
        self.slot: dict[int, int] = {}  # node -> its offset among the cache's uncommitted entries

    def __call__(self, tree: TreeGrowth, frontier: list[int], depth: int) -> torch.Tensor:  # [F, V]
        pending = self.cache.pending
        f = len(frontier)
        mask = torch.zeros(f, pending + f, dtype=torch.bool)  # [F, pending+F]
        for row, node in enumerate(frontier):
            mask[row, [self.slot[a] for a in tree.ancestors[node]]] = True
            mask[row, pending + row] = True
            self.slot[node] = pending + row
        ids = torch.tensor([tree.tokens[n] for n in frontier])
        positions = torch.full((f,), self.committed + depth - 1)
        return self.model.forward(self.cache, ids, positions, mask)


@lru_cache(maxsize=8)
def with_draft_vocabulary(model: CausalLM, size: int) -> CausalLM:
    """The draft model scoring only its `size` most frequent tokens (vocabulary.py). Its LM head reads those rows
    only, the largest saving of a small model's forward (its vocabulary is the target's); the others get -inf,
    so the draft never proposes them (a draft, greedy or sampled, may leave out any token: still lossless)."""
    ids = frequent_tokens(model, size)
    if not isinstance(getattr(model, "lm_head", None), Linear):  # not ours to slice: the same draft, no saving
        return _MaskedLogits(model, ids)
    restricted = copy.copy(model)  # shares the blocks and weights; only the head differs
    restricted.lm_head = VocabularyHead.of(model.lm_head, ids, model.vocab_size)
    return restricted


class _MaskedLogits:
    """A model whose logits are -inf off the draft vocabulary (for models whose LM head is not a native Linear)."""

    def __init__(self, model: CausalLM, ids: torch.Tensor):
        self.model, self.ids = model, ids

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, *args, **kwargs) -> torch.Tensor:  # [..., V]
        logits = self.model.forward(*args, **kwargs)
        masked = torch.full_like(logits, float("-inf"))
        masked[..., self.ids] = logits[..., self.ids]
        return masked


@lru_cache(maxsize=8)
def _same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def check_same_vocabulary(target: CausalLM, draft: CausalLM) -> None:
    # Cached: the server builds a drafter per request, and comparing two 150k-entry vocabularies takes a while.
    if not _same_vocabulary(target.tokenizer, draft.tokenizer):
        raise SpecDecodeError(
            f"draft model {draft.name} uses a different tokenizer than the target {target.name}.",
            "Use a draft model of the same family (same tokenizer), or a drafter for any tokenizer: "
            "--drafter slem (string-level exact match), tli (token-level intersection) or slrs (string-level "
            "rejection sampling).",
        )
