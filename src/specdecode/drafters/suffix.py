"""SuffixDecoding (Oliaro et al., 2024) with REST's retrieval (He et al., 2023): draft what followed the longest
suffix of the context that occurred before.

Sources: the current request's tokens (prompt and output so far, copied in as the context grows), the outputs of
earlier requests (the last `max_history` tokens; SuffixDecoding's global tree), and REST's datastore (option
`corpus`: "sharegpt", the default, is the ShareGPT answers shipped with specdecode; a text or .jsonl file; "none";
datastore.py indexes it with a suffix array, built once per tokenizer and cached). The longest suffix of at most
`max_match` tokens that occurs in the request or the history (REST tries lengths 16..2; here one numpy scan narrows
the last token's occurrences one token at a time) gives up to `max_occurrences` occurrences, most recent first; the
datastore's longest match (binary searches in its suffix array) gives as many, spread over its occurrences. Each
set of continuations forms a trie whose nodes are weighted by frequency: a child's probability is count(child) /
count(parent), so a path's probability is the share of occurrences that continue along it (SuffixDecoding's
speculation tree). The most probable nodes are kept, down to `min_prob`, up to an adaptive budget that grows with
the match: ceil(alpha * match length), capped at max_nodes (SuffixDecoding's max_spec_factor). Of the two trees the
one expecting more accepted tokens (the sum of its nodes' probabilities) is drafted, the request's on a tie
(SuffixDecoding's choice between its prompt tree and its global tree).
Deterministic drafts (draft_probs None): sampling uses the point-mass rule and stays lossless.
Defaults (alpha, min_prob) by tau replayed against the target's recorded greedy outputs on held-out ShareGPT and the
shipped tuning prompts (benchmarks/results name the runs).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import OptionError
from ..tree import Draft, trie
from .base import Drafter, register
from .datastore import SEPARATOR, SHAREGPT, datastore, until_separator
from .ngram_table import suffix_matches


@register("suffix")
class SuffixDrafter(Drafter):
    sizes = {"max_nodes": "nodes"}
    variants = ({}, {"alpha": 1.0, "max_nodes": 6, "min_prob": 0.3}, {"max_match": 2, "max_occurrences": 1})
    tune_grid = ({"max_nodes": 8}, {"max_nodes": 32, "alpha": 8.0}, {"alpha": 2.0, "min_prob": 0.05},
                 {"max_nodes": 8, "min_prob": 0.2}, {"corpus": "none"})  # the last: where the datastore does not pay

    def __init__(
        self,
        target,
        max_match: int = 16,
        max_nodes: int = 16,
        alpha: float = 4.0,
        min_prob: float = 0.1,
        max_occurrences: int = 64,
        max_history: int = 100_000,
        corpus: str = SHAREGPT,
    ):
        if min(max_match, max_nodes, max_occurrences) < 1 or alpha <= 0 or not 0 <= min_prob <= 1 or max_history < 0:
            raise OptionError(
                "need max_match, max_nodes, max_occurrences >= 1, alpha > 0, 0 <= min_prob <= 1 and max_history >= 0"
            )
        self.max_match, self.max_nodes, self.alpha = max_match, max_nodes, alpha
        self.min_prob, self.max_occurrences, self.max_history = min_prob, max_occurrences, max_history
        self.datastore = datastore(corpus, target.tokenizer) if corpus not in ("none", "") else None
        self.history = np.zeros(0, dtype=np.int64)  # [H] earlier requests' outputs, each followed by SEPARATOR
        self.tokens = np.zeros(0, dtype=np.int64)  # this request's tokens; the first `length` are filled
        self.length = 0
        self.prompt_len = 0

    def start(self, prompt_ids, capacity):
        if self.max_history and self.length > self.prompt_len:  # the previous request's output joins the history
            output = np.append(self.tokens[self.prompt_len : self.length], SEPARATOR)
            self.history = np.concatenate([self.history, output])[-self.max_history :]
        self.tokens = np.zeros(capacity, dtype=np.int64)
        self.length = 0
        self.prompt_len = len(prompt_ids)

    def propose(self, context, params, generator) -> Draft:
        return self.lookup(context)[1]

    def lookup(self, context: list[int]) -> tuple[int, Draft]:
        """The chosen suffix match's length (0: none) and its speculation tree: the request's and earlier outputs'
        longest match, or the datastore's where its tree expects more accepted tokens (SuffixDecoding picks between
        its prompt tree and its global tree by the same score). A document being summarised matches a shorter suffix
        than a corpus of millions of tokens does, yet predicts its copy far better."""
        self._append(context[self.length :])  # the first token (sampled at prefill) is not in any verdict
        own = self.tokens[: self.length]
        suffix = own[-self.max_match :]
        candidates = [self._recent(own, suffix)]
        if self.datastore is not None:
            match = self.datastore.longest_match(suffix)
            found = self.datastore.continuations(match, self.max_occurrences, self._budget(match.length))
            candidates.append((match.length, found))
        scored = [(length, *speculation_tree(found, self._budget(length), self.min_prob)) for length, found in candidates]
        match_len, draft, _ = max(scored, key=lambda candidate: candidate[2])  # a tie: the request's own
        return match_len, draft

    def _recent(self, own: np.ndarray, suffix: np.ndarray) -> tuple[int, list[list[int]]]:
        """The longest match in this request and the earlier outputs, and its continuations, most recent first."""
        sources = [(tokens, suffix_matches(tokens, suffix, self.max_match)) for tokens in (own, self.history)]
        match_len = max(len(levels) for _, levels in sources)
        budget = self._budget(match_len)
        continuations: list[list[int]] = []
        for tokens, levels in sources:
            if match_len and len(levels) == match_len:
                ends = levels[-1][::-1][: self.max_occurrences - len(continuations)]  # most recent first
                continuations += [until_separator(tokens[end : end + budget]) for end in ends]
        return match_len, continuations

    def _budget(self, match_len: int) -> int:
        return min(self.max_nodes, math.ceil(self.alpha * match_len))

    def commit(self, verdict, draft, target_logits) -> None:
        self._append(verdict.new_tokens)  # here rather than at the next proposal: the last step's tokens count too

    def _append(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > len(self.tokens):
            self.tokens = np.resize(self.tokens, 2 * end)
        self.tokens[self.length : end] = tokens
        self.length = end


def speculation_tree(continuations: list[list[int]], budget: int, min_prob: float) -> tuple[Draft, float]:
    """The `budget` most frequent nodes of the continuations' trie whose share of the continuations is at least
    min_prob, most frequent first (ties: the earlier listed continuation), and the tokens it is expected to have
    accepted were the continuations what follows: the sum of the kept nodes' shares. A child is never more frequent
    than its parent and comes later in the trie, so parents rank first and the kept nodes form a tree."""
    if not continuations:
        return Draft.empty(), 0.0
    merged = trie(continuations)
    tokens, parents, counts = merged.tokens, merged.parents, merged.counts
    ranked = sorted(range(len(tokens)), key=lambda node: (-counts[node], node))[:budget]
    kept = [node for node in ranked if counts[node] >= min_prob * len(continuations)]
    draft = Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
    expected = sum(counts[node] for node in kept) / len(continuations)
    return draft.subset(torch.tensor(kept, dtype=torch.long)), expected
