"""StreamingLLM self-speculation (MagicDec, Chen et al. 2024, arXiv 2408.11049; TriForce's middle level, Sun et al.
2024, arXiv 2404.11912): the target itself drafts for the target, reading only its attention sinks (the context's
first `sinks` tokens) and a recent `window` of its KV cache (StreamingLLM's cache, Xiao et al. 2023), then the
full target verifies, so the output is the target's (lossless, greedy and sampling).

Why it pays at long context only: a draft step costs the target's linear layers (and attention over sinks + window),
a verification step its linear layers plus attention over the whole context for every verified row. Where attention
over the context is a large share of a decode step (many thousand tokens), a draft token costs a fraction of a
target step and is almost always accepted (the window predicts the next tokens well); at a short context the draft
is the target at full price, so below `min_context` committed tokens it proposes nothing and decoding is plain.

The drafter's cache is its own small KVCache of the target's format: the sinks, then the window as a ring of
`window` slots, mirrored from the target's committed entries (exact target keys and values, rotated at their true
positions: queries run at their true positions too), then the draft's uncommitted entries, dropped after each
proposal. Mirroring copies only the entries committed since the last proposal; attention is order-independent up
to rounding, and the draft need not be exact: only the target's verification is.
"""

from __future__ import annotations

import torch

from ..errors import OptionError
from ..tree import Draft
from .base import register
from .self_draft import SelfDrafter


@register("streaming")
class StreamingSelfDrafter(SelfDrafter):
    needs_sublayers = False  # a whole-model forward over its own cache: any backend
    sizes = {}  # drafting costs a target forward per token: the adaptive length decides, not the verify curve
    variants = ({"min_context": 0}, {"min_context": 0, "sinks": 2, "window": 5, "depth": 3, "length": "fixed"})
    tune_grid = ({"window": 128}, {"window": 512}, {"depth": 10, "threshold": 0.5}, {"min_context": 4096})

    def __init__(self, target, sinks: int = 4, window: int = 256, depth: int = 8, threshold: float = 0.6,
                 length: str = "adaptive", min_context: int = 2048):
        super().__init__(target, depth, length, threshold)
        if sinks < 0 or window < 1 or min_context < 0:
            raise OptionError("need sinks >= 0, window >= 1 and min_context >= 0")
        self.sinks, self.window, self.min_context = sinks, window, min_context
        self.own = None  # KVCache: sinks, the window ring, then this proposal's uncommitted draft entries
        self.mirrored = 0  # the target's committed entries mirrored so far (positions 0..mirrored-1)

    def own_capacity(self) -> int:
        """Entries the drafter's cache needs: the sinks, the window, the root and a draft."""
        return self.sinks + self.window + self.max_nodes + 1

    def start(self, prompt_ids, capacity) -> None:
        self.mirrored = 0
        if self.own is None:
            self.own = self.target.new_cache(self.own_capacity())
        self.own.truncate(0)

    def propose(self, context, params, generator) -> Draft:
        if len(context) - 1 < self.min_context:
            return Draft.empty()
        return super().propose(context, params, generator)

    def begin(self, context) -> None:
        self._mirror(self.cache.length)

    def _mirror(self, committed: int) -> None:
        """Copy the target's entries committed since the last call into the sinks and the window ring."""
        sinks, window, start = self.sinks, self.window, self.mirrored
        positions = list(range(start, min(sinks, committed)))
        positions += range(max(start, sinks, committed - window), committed)
        if positions:
            source = torch.tensor(positions)  # [n] the target's slots (= positions)
            slots = torch.where(source < sinks, source, sinks + (source - sinks) % window)  # [n] ours
            target = self.cache
            self.own.keys[:, :, :, slots] = target.keys.index_select(3, source)
            self.own.values[:, :, :, slots] = target.values.index_select(3, source)
            self.own.positions[slots] = source
        self.mirrored = committed
        self.own.length = self.own.end = min(committed, sinks + window)

    def next_logits(self, token, position):
        see_all = torch.ones(1, self.own.pending + 1, dtype=torch.bool)  # [1, pending+1]
        ids, positions = torch.tensor([token]), torch.tensor([position])
        return self.target.forward(self.own, ids, positions, see_all)[0]

    def finish(self, tokens, draft_probs, root) -> Draft:
        self.own.discard()
        return super().finish(tokens, draft_probs, root)
