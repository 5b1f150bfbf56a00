"""Prompt lookup decoding (Saxena, 2023): continue the longest recent n-gram match found in the context.

Several matches with different continuations become branches of one deterministic tree (draft_probs None).
"""

from __future__ import annotations

import numpy as np

from ..errors import OptionError
from ..tree import Draft, from_sequences
from .base import Drafter, register
from .ngram_table import suffix_matches


@register("pld")
class PromptLookupDrafter(Drafter):
    variants = ({}, {"branches": 3, "k": 4}, {"max_ngram": 1, "k": 2})
    tune_grid = ({"k": 2}, {"k": 4}, {"k": 4, "branches": 2}, {"k": 8, "branches": 2}, {"k": 16})

    def __init__(self, target, max_ngram: int = 3, min_ngram: int = 1, k: int = 8, branches: int = 1):
        if not 1 <= min_ngram <= max_ngram or k < 1 or branches < 1:
            raise OptionError("need 1 <= min_ngram <= max_ngram, k >= 1 and branches >= 1")
        self.max_ngram, self.min_ngram, self.k, self.branches = max_ngram, min_ngram, k, branches
        self.max_nodes = k * branches

    def propose(self, context, params, generator) -> Draft:
        return from_sequences(find_continuations(context, self.max_ngram, self.min_ngram, self.k, self.branches))


def find_continuations(context: list[int], max_ngram: int, min_ngram: int, k: int, branches: int) -> list[list[int]]:
    """Up to `branches` distinct continuations of <= k tokens that followed earlier occurrences of the context's
    last n tokens; longer n-grams first, then the most recent occurrence first."""
    ctx = np.asarray(context, dtype=np.int64)
    levels = suffix_matches(ctx, ctx, max_ngram)  # levels[n-1]: where the last n tokens occurred earlier
    found: list[list[int]] = []
    for n in range(len(levels), min_ngram - 1, -1):
        for end in levels[n - 1][::-1]:  # most recent first
            continuation = ctx[end : end + k].tolist()
            if continuation not in found:
                found.append(continuation)
                if len(found) == branches:
                    return found
    return found
