"""Medusa-1 (Cai et al., 2024, arXiv 2401.10774): K heads on the target's last feature each guess one token further
ahead; the tree is a static shape over their ranked guesses (a node at depth k with sibling rank r holds head k's
r-th most likely token), drafted with no forward of any draft model.

The shape is Sequoia's dynamic program over `budget` nodes and the heads' depth for per-rank acceptances `accept`
(tree.sequoia_tree), the role Medusa's hand-tuned `medusa_choices` play. The feature is the target's last hidden
state (after its final norm) at the last token in its cache, which the target hands over after each verification.
Trees are deterministic (draft_probs None), lossless under sampling by the verifier's point-mass rule.
"""

from __future__ import annotations

import torch

from ..errors import OptionError
from ..heads import target as target_side
from ..tree import Draft, sequoia_tree
from .base import register
from .tree_growth import _probabilities
from .eagle import HeadDrafter


@register("medusa")
class MedusaDrafter(HeadDrafter):
    kind = "medusa"
    sizes = {"budget": "nodes"}
    variants = ({}, {"budget": 3, "accept": "0.9"}, {"budget": 10, "accept": "0.5,0.2,0.1"})
    tune_grid = ({"budget": 4}, {"budget": 8}, {"budget": 16})

    def __init__(self, target, draft_model=None, budget: int = 8, accept: str = "0.6,0.15,0.08,0.04"):
        super().__init__(target, draft_model)
        if budget < 1:
            raise OptionError("need budget >= 1")
        self.heads = self.head.config.num_heads
        parents = sequoia_tree(budget, self.heads, _probabilities(accept))[1]
        self.parents = torch.tensor(parents, dtype=torch.long)  # [N]
        self.depth_rank = _depth_and_rank(parents)  # per node: (depth - 1, sibling rank)
        self.width = max(rank for _, rank in self.depth_rank) + 1
        self.max_nodes = len(parents)

    @torch.inference_mode()
    def propose(self, context, params, generator) -> Draft:
        feature = self.features.since(self.features.count - 1)  # [1, d]: the last token in the target's cache
        outputs = self.head(feature)[0]  # [K, d]
        logits = target_side.lm_head(self.target, outputs)  # [K, V]
        guesses = torch.topk(logits, min(self.width, logits.shape[-1]), dim=-1).indices  # [K, width]
        tokens = torch.tensor([int(guesses[depth, rank]) for depth, rank in self.depth_rank])
        return Draft(tokens, self.parents)


def _depth_and_rank(parents: list[int]) -> list[tuple[int, int]]:
    out, seen = [], {}
    for node, parent in enumerate(parents):
        depth = 0 if parent < 0 else out[parent][0] + 1
        rank = seen.get(parent, 0)
        seen[parent] = rank + 1
        out.append((depth, rank))
    return out
