"""TLI, Token-Level Intersection (Timor et al., 2025, arXiv 2502.05202, Algorithm 4; transformers' universal
assisted generation when sampling): the draft model's next-token distribution restricted to the tokens both
vocabularies share (the same bytes), renormalised, and written in target ids. A chain of such tokens goes to the
rejection verifier with those distributions as draft_probs [N, V_target], so it is ordinary speculative sampling
in the target's vocabulary: lossless, and greedy when the request is (the argmax of the restricted distribution,
draft_probs None).

Each level's proposal is a distribution over target tokens plus, for every target token, the draft-token paths
that spell it; TLI's paths are single shared draft tokens. slrs.py widens the proposal to paths of several draft
tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams, probs_from_logits
from ..tree import Draft
from .base import register
from .foreign import ForeignDrafter, bridge


Path = tuple[float, int, int]  # (path probability, the draft-tree node it hangs below (-1: the text), last draft token)


@dataclass
class Proposal:
    """One level's proposal: mass [Vt] over target tokens (not normalized), and the draft paths spelling a given
    target token (each ends in one draft token not yet run)."""

    mass: torch.Tensor  # [Vt]
    paths_of: Callable[[int], list[Path]]


@register("tli")
class TLIDrafter(ForeignDrafter):
    variants = ({}, {"depth": 8, "length": "confidence", "threshold": 0.3})
    tune_grid = ({"depth": 4}, {"depth": 8, "length": "confidence", "threshold": 0.4})

    def __init__(self, target, draft_model, depth: int = 6, length: str = "fixed", threshold: float = 0.4):
        super().__init__(target, draft_model, depth, length, threshold)
        self.bridge = bridge(target, draft_model)

    def propose(self, context, params: SamplingParams, generator) -> Draft:
        logits = self.view.sync(context, self.depth * self.tree_nodes_per_level())  # [Vd]
        if logits is None:
            return Draft.empty()
        tokens, rows, node, confidence = [], [], -1, 1.0
        levels = self.length.depth_within(self.depth_limit)
        for level in range(levels):
            proposal = self.propose_level(logits, node, params)
            total = float(proposal.mass.sum())
            if total <= 0:  # the draft puts no mass on anything the target could say
                break
            q = proposal.mass / total  # [Vt]
            token = int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=generator))
            _, parent, draft_token = self.pick_path(proposal.paths_of(token), params, generator)
            tokens.append(token)
            rows.append(q)
            confidence *= float(q[token])
            if level + 1 == levels or not self.length.grow(confidence):
                break
            logits = self.view.grow([draft_token], [parent])[0]
            node = len(self.view.nodes) - 1
        self.view.drop_tree()
        return Draft.chain(tokens, None if params.greedy or not tokens else torch.stack(rows))

    def tree_nodes_per_level(self) -> int:
        """Most draft-model entries one level adds to the draft tree."""
        return 1

    def propose_level(self, logits: torch.Tensor, node: int, params: SamplingParams) -> Proposal:
        """The proposal after draft-tree node `node` (-1: the committed text), whose [Vd] logits are given: the
        shared tokens' draft probabilities."""
        draft_probs = self.draft_distribution(logits, params)  # [Vd]
        draft_to_target = self.bridge.draft_to_target[: draft_probs.shape[0]]

        def paths_of(target_token: int) -> list[Path]:
            same = (draft_to_target == target_token).nonzero().flatten().tolist()
            return [(float(draft_probs[d]), node, d) for d in same]

        return Proposal(self.bridge.to_target(draft_probs), paths_of)

    @staticmethod
    def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[Vd] the draft model's distribution: warped as the request samples; plain softmax when greedy, so the
        argmax over shared tokens is taken from real probabilities."""
        return torch.softmax(logits.float(), -1) if params.greedy else probs_from_logits(logits, params)

    @staticmethod
    def pick_path(paths, params: SamplingParams, generator):
        """The draft path behind the chosen target token: the likeliest (greedy) or one drawn by probability."""
        if params.greedy or len(paths) == 1:
            return max(paths, key=lambda p: p[0])
        weights = torch.tensor([p[0] for p in paths])
        return paths[int(torch.multinomial(weights / weights.sum(), 1, generator=generator))]

