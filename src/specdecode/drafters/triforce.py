"""TriForce (Sun et al., COLM 2024, arXiv 2404.11912): hierarchical speculation for long contexts, lossless.

Three levels: a small draft model reading only a StreamingLLM cache of the context (its sinks and last
`draft_window` tokens: draft.py's `window`) drafts `draft_depth` tokens for the middle level; the middle level is
the target itself over a partial cache (its sinks and recent `window` entries: streaming.py's cache) and verifies
that draft in one forward, keeping its accepted path and bonus token; it repeats until it holds a chain of `depth`
tokens, which the full target verifies. The middle level's verification is itself lossless with respect to the
middle level (greedy match, or rejection sampling against the draft model's distributions), so each chain token is
distributed as the middle level's warped distribution at its place; the chain carries those distributions as its
draft_probs, and the target's own verification keeps the output the target's.

Why the hierarchy: the middle level drafts well (it is the target, missing only the far context) but a middle
forward costs the target's linear layers; the draft model makes most of its tokens for the price of one middle
forward over several rows, which at a short cache costs little more than one row. The paper's retrieval cache
(chunks of the context chosen by the current query's attention) is replaced here by the recent window; below
`min_context` committed tokens the drafter proposes nothing (plain decoding: the target reads its whole cache
anyway).
"""

from __future__ import annotations

import torch

from ..errors import OptionError
from ..models.base import tree_request
from ..sampling import probs_from_logits
from ..tree import Draft
from ..verify import verifier_for
from .base import register
from .draft_model import DraftModelDrafter
from .streaming import StreamingSelfDrafter


@register("triforce")
class TriForceDrafter(StreamingSelfDrafter):
    needs_draft_model = True
    catches_up = True  # the draft model prefills (its window of) the tokens decoded plainly
    variants = (
        {"min_context": 0, "window": 6, "draft_window": 5, "depth": 5, "draft_depth": 2},
        {"min_context": 0, "sinks": 0, "window": 3, "draft_depth": 3, "draft_topk": 2},
    )
    tune_grid = ({"depth": 12}, {"draft_depth": 6}, {"window": 512}, {"min_context": 4096})

    def __init__(self, target, draft_model, sinks: int = 4, window: int = 256, depth: int = 8,
                 min_context: int = 2048, draft_depth: int = 4, draft_topk: int = 1, draft_window: int = 256):
        super().__init__(target, sinks, window, depth, 0.0, "fixed", min_context)
        if draft_depth < 1 or draft_topk < 1:
            raise OptionError("need draft_depth >= 1 and draft_topk >= 1")
        self.inner = DraftModelDrafter(target, draft_model, depth=draft_depth, topk=draft_topk,
                                       budget=draft_depth * draft_topk, window=draft_window)

    def own_capacity(self) -> int:
        """The sinks and window, the middle level's kept chain (up to depth tokens and a bonus beyond), and one more
        draft-model draft with its root over it."""
        return self.sinks + self.window + 2 * self.max_nodes + self.inner.max_nodes + 2

    def start(self, prompt_ids, capacity) -> None:
        super().start(prompt_ids, capacity)
        self.inner.start(prompt_ids, capacity + self.max_nodes)

    def propose(self, context, params, generator) -> Draft:
        depth = self.max_nodes if self.depth_limit is None else min(self.max_nodes, self.depth_limit)
        if len(context) - 1 < self.min_context or depth < 1:
            return Draft.empty()
        self._mirror(self.cache.length)
        verifier = verifier_for(params)
        chain: list[int] = []
        rows: list[torch.Tensor] = []  # [V] the middle level's warped distribution of each chain token
        root = len(context) - 1  # the true position of context[-1], the next free one in the target's cache
        while len(chain) < depth:
            ahead = context + chain
            self.inner.depth_limit = depth - len(chain)
            draft = self.inner.propose(ahead, params, generator)
            middle_logits = tree_request(self.own, ahead[-1], draft, root_position=root + len(chain)).run(self.target)
            verdict = verifier.verify(draft, middle_logits, params, generator)
            kept = [0] + [i + 1 for i in verdict.accepted]  # the root and the accepted path
            self.own.keep(kept)
            self.inner.commit(verdict, draft, middle_logits)
            chain += verdict.new_tokens
            if not params.greedy:
                rows += [probs_from_logits(middle_logits[row], params) for row in kept]
        self.own.truncate(min(self.cache.length, self.sinks + self.window))
        return Draft.chain(chain[:depth], None if params.greedy else torch.stack(rows[:depth]))

    def commit(self, verdict, draft, target_logits) -> None:
        """Nothing to learn: the draft model's tree policy learned from the middle level's verdicts."""
