"""SuffixDecoding's hybrid (Oliaro et al., 2024) around any drafter: when the context's last `lookup` or more tokens
occurred before (in this request or earlier outputs, suffix.py), that match's speculation tree (up to
`lookup_nodes` nodes) is sent and the wrapped drafter does not run this step. Copy-heavy text (summaries, retrieval
answers, code edits) is then drafted for free and further ahead than the drafter would reach.

Every drafter takes the options `lookup` (0, the default, turns the hybrid off) and `lookup_nodes`; build_drafter
wraps it when lookup > 0. The wrapped drafter sees `commit` only for its own drafts (it catches up on skipped
tokens from the context at its next proposal) and every `receive_hidden` (those describe the target's cache, not
a draft).
"""

from __future__ import annotations

from ..errors import OptionError
from ..sampling import SamplingParams
from ..tree import Draft
from .base import Drafter
from .suffix import SuffixDrafter

HYBRID_OPTIONS = {"lookup": 0, "lookup_nodes": 16}  # the options every drafter takes, with their defaults


class LookupHybrid(Drafter):
    """`inner`, with the suffix tree's draft instead whenever the lookup matches at least `lookup` tokens."""

    def __init__(self, inner: Drafter, target, lookup: int, lookup_nodes: int = HYBRID_OPTIONS["lookup_nodes"]):
        if lookup < 1 or lookup_nodes < 1:
            raise OptionError("need lookup >= 1 (0 turns the lookup off) and lookup_nodes >= 1")
        self.inner, self.lookup = inner, lookup
        self.retrieval = SuffixDrafter(target, max_nodes=lookup_nodes, corpus="none")  # this request, earlier outputs
        # What the engine and the governor read of a drafter is the wrapped one's, the node bound covering both
        # drafts. catches_up too: after a lookup step (or a governor rest) the inner drafter first processes the
        # tokens it skipped, a slow step the governor must not judge.
        self.name, self.supports_sampling, self.catches_up = inner.name, inner.supports_sampling, inner.catches_up
        self.needs_sublayers = inner.needs_sublayers
        self.max_nodes = max(inner.max_nodes, lookup_nodes)
        self.hidden_layers = inner.hidden_layers
        self.looked_up = False  # the current draft came from the lookup, not from `inner`

    def use_target_cache(self, cache) -> None:
        self.inner.use_target_cache(cache)

    def start(self, prompt_ids, capacity):
        self.inner.start(prompt_ids, capacity)
        self.retrieval.start(prompt_ids, capacity)

    def propose(self, context, params: SamplingParams, generator) -> Draft:
        match_len, found = self.retrieval.lookup(context)
        self.looked_up = match_len >= self.lookup and len(found) > 0
        if self.looked_up:
            return found
        self.inner.depth_limit = self.depth_limit
        return self.inner.propose(context, params, generator)

    def receive_hidden(self, hidden) -> None:
        self.inner.receive_hidden(hidden)

    def commit(self, verdict, draft, target_logits) -> None:
        self.retrieval.commit(verdict, draft, target_logits)
        if not self.looked_up:
            self.inner.commit(verdict, draft, target_logits)
