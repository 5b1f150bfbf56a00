"""Lookahead decoding (Fu et al., 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding", arXiv 2402.02057): a Jacobi window of W columns x (N-1) levels plus an n-gram pool, no draft model.

The window. Level l, column j holds a guess for the token `j + l` positions after the last committed token
(the root; column 0 of level 0 is the root itself). Level 0 is a chain below the root (the spine); the
higher levels of column j hang below spine node j, one per level. That is exactly the attention pattern of
the paper's 2-D window (each token sees the spine up to its column, then its own column), so the window is an
ordinary draft tree whose depths give the positions, and the spine is real speculation too.

One step = one target forward over [window tree + pool candidates]:
- the target's argmax at the top level of column j is the next Jacobi guess `new[j]`;
- the n-gram (level0[j], level1[j], ..., level_{N-2}[j], new[j]) joins the pool, keyed by its first token;
- the levels move down one (the oldest is dropped, `new` becomes the top) and shift left by the number of
  accepted tokens, so every guess keeps its absolute position; emptied columns get random context tokens.
During the first N-2 steps the levels fill up instead (warm-up).
The pool (also fed with the context's own n-grams) offers up to G continuations of the last token; they and
the window share one trie. The draft is deterministic (draft_probs None), so greedy and sampling verification
are both lossless whatever the window holds; the window always follows the target's argmax, as in the paper.
"""

from __future__ import annotations

import random

from ..errors import OptionError
from ..tree import Draft, trie
from .base import Drafter, register
from .ngram_table import NgramTable


@register("lookahead")
class LookaheadDrafter(Drafter):
    variants = ({}, {"window": 4, "level": 4, "guess": 2}, {"window": 5, "level": 2, "guess": 3})
    tune_grid = ({"window": 3, "level": 3, "guess": 2}, {"window": 7, "level": 4, "guess": 5})

    def __init__(self, target, window: int = 5, level: int = 3, guess: int = 3, pool_from_context: bool = True):
        if window < 2 or level < 2 or guess < 0:
            raise OptionError("need window >= 2, level >= 2 and guess >= 0")
        self.window, self.level, self.guess = window, level, guess
        self.pool_from_context = pool_from_context
        self.eos = target.eos_token_ids
        self.max_nodes = (window - 1) + window * (level - 2) + guess * (level - 1)
        self.start([0], 0)

    def start(self, prompt_ids, capacity):
        self.rng = random.Random(0)
        self.context = list(prompt_ids)
        self.pool = NgramTable(key_lengths=(1,), length=self.level - 1, per_key=max(self.guess, 1))
        self.levels = [self.random_tokens(self.window)]  # levels[l][j]: guess at offset j + l
        self.draft: Draft | None = None
        self.nodes: list[list[int]] = []  # nodes[l][j]: draft node of levels[l][j] (-1 = the root)

    def random_tokens(self, n: int) -> list[int]:
        return [self.rng.choice(self.context) for _ in range(n)]

    def propose(self, context, params, generator) -> Draft:
        self.context = context
        if self.pool_from_context:
            self.pool.extend(context)
        self.levels[0][0] = context[-1]
        spine = self.levels[0][1:]
        columns = [spine[:j] + [lv[j] for lv in self.levels[1:]] for j in range(self.window)]
        candidates = self.pool.lookup(context, self.guess) if self.guess else []
        merged = trie([spine] + columns + candidates)
        self.draft, nodes = merged.draft(), merged.paths
        self.nodes = [[-1] + nodes[0]] + [
            [nodes[1 + j][j + l - 1] for j in range(self.window)] for l in range(1, len(self.levels))
        ]
        return self.draft

    def commit(self, verdict, draft, target_logits) -> None:
        if draft is not self.draft:  # cut short at the end of the request: nothing more to look ahead for
            return
        argmax = target_logits.argmax(-1).tolist()  # [N+1]: row 0 = root, row i+1 = node i
        new = [self.fresh(argmax[node + 1]) for node in self.nodes[-1]]  # guesses one level up
        shift = len(verdict.accepted) + 1  # the root moved this many positions
        if len(self.levels) == self.level - 1:
            self.harvest(new)
            self.levels = [self.shifted(lv, shift - 1) for lv in self.levels[1:] + [new]]
        else:  # warm-up: keep every level, add the new one on top
            self.levels = [self.shifted(lv, shift) for lv in self.levels + [new]]

    def harvest(self, new: list[int]) -> None:
        """Each column's trajectory, topped by its new guess, is an N-gram the target itself produced."""
        for j in range(self.window):
            self.pool.add_sequence([lv[j] for lv in self.levels] + [new[j]])

    def shifted(self, tokens: list[int], by: int) -> list[int]:
        """Columns moved left by `by` positions; the emptied ones refilled with random context tokens."""
        kept = tokens[by:]
        return kept + self.random_tokens(len(tokens) - len(kept))

    def fresh(self, token: int) -> int:
        """End-of-sequence guesses are replaced, as in the paper's code (they stall the window)."""
        return self.random_tokens(1)[0] if token in self.eos else token
