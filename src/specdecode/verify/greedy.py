"""Greedy verification: follow the draft while it matches the target's argmax; the argmax after is the bonus."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from ..tree import Draft, children, with_root
from .base import Verdict, Verifier, verdict


class GreedyVerifier(Verifier):
    def verify(self, draft: Draft, target_logits: torch.Tensor, params: SamplingParams, generator) -> Verdict:
        target_argmax = target_logits.argmax(-1).tolist()  # [N+1]; a PROBE node (token -1) never matches
        kids = children(with_root(draft.parents))  # over [root, nodes...]
        tokens = [None] + draft.tokens.tolist()
        node, accepted = 0, []
        while True:
            match = next((c for c in kids[node] if tokens[c] == target_argmax[node]), None)
            if match is None:
                return verdict(draft, accepted, target_argmax[node])
            accepted.append(match - 1)
            node = match
