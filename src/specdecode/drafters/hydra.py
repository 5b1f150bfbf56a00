"""Hydra (Ankner et al., 2024, arXiv 2402.05109): a tree drafted by sequentially dependent heads (heads/hydra.py). A
node at depth k is expanded by head k from the target's last feature and the embeddings of the root and the tokens
on its path, so siblings' children differ (Medusa's heads give every node at a depth the same guesses). Each level
costs one small head product per frontier node and the shared LM head; the tree's shape is any tree_growth
structure (EAGLE-2's dynamic tree by default), at most as deep as the head has heads."""

from __future__ import annotations

import torch

from ..heads import target as target_side
from ..sampling import SamplingParams
from .base import register
from .eagle import HeadDrafter
from .tree_growth import TreeGrowth, TreeStrategy


@register("hydra")
class HydraDrafter(HeadDrafter):
    kind = "hydra"
    sizes = {"depth": "depth", "budget": "nodes"}
    variants = ({}, {"depth": 2, "topk": 1}, {"structure": "sequoia", "budget": 5, "depth": 3})
    tune_grid = ({"topk": 1}, {"topk": 2, "budget": 6}, {"topk": 4, "budget": 16}, {"structure": "opt", "budget": 10})

    def __init__(self, target, draft_model=None, structure: str = "eagle2", depth: int = 4, topk: int = 3,
                 budget: int = 10, length: str = "fixed", threshold: float = 0.4, min_gain: float = 0.1,
                 accept: str = "0.7,0.1,0.04,0.02"):
        super().__init__(target, draft_model)
        depth = min(depth, self.head.config.num_heads)  # head k guesses depth k + 1: no head guesses deeper
        self.tree = TreeStrategy(structure, depth, topk, budget, length, threshold, min_gain, accept)
        self.max_nodes = self.tree.max_nodes

    @torch.inference_mode()
    def propose(self, context, params: SamplingParams, generator):
        feature = self.features.since(self.features.count - 1)[0]  # [d]: the last token in the target's cache
        expansion = _PathExpansion(self, feature, context[-1])
        root_logits = expansion.logits(0, [[context[-1]]])[0]  # head 0: the root's children
        return self.tree.grow(expansion, root_logits, params, generator, self.depth_limit)

    def commit(self, verdict, draft, target_logits) -> None:
        self.tree.update(verdict, draft)


class _PathExpansion:
    """The expand callback of one proposal: head `depth` over each frontier node's path from the root."""

    def __init__(self, drafter: HydraDrafter, feature: torch.Tensor, root: int):
        self.drafter, self.feature, self.root = drafter, feature, root

    def __call__(self, tree: TreeGrowth, frontier: list[int], depth: int) -> torch.Tensor:  # [F, V]
        paths = [[self.root] + [tree.tokens[a] for a in tree.ancestors[node]] + [tree.tokens[node]]
                 for node in frontier]  # depth + 1 tokens each
        return self.logits(depth, paths)

    def logits(self, k: int, paths: list[list[int]]) -> torch.Tensor:  # head k over F paths of k + 1 tokens: [F, V]
        drafter = self.drafter
        embeds = target_side.embed(drafter.target, torch.tensor(paths))  # [F, k+1, d]
        features = self.feature.expand(len(paths), -1)  # [F, d]
        outputs = drafter.head(k, features, embeds)  # [F, d]
        return target_side.lm_head(drafter.target, outputs)
