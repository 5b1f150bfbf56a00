"""Token Recycling (Luo et al., 2024): recycle the target's own top-k candidates as a next-token table.

An adjacency table adj[token] holds the k most likely successors the target predicted after `token` the last time
it saw it; every node of every verified tree updates it, accepted or not. A draft is a static tree of candidate
ranks expanded breadth-first from the last committed token. Deterministic drafts (draft_probs None), so sampling
uses the point-mass rule. The table lives as long as the drafter (across requests), as in the paper.
"""

from __future__ import annotations

import itertools

import torch

from ..tree import Draft
from .base import Drafter, register


def rank_template(branching: tuple[int, ...], rank_budget: int) -> list[tuple[int, ...]]:
    """Rank paths (r1..rd), r_i < branching[i-1], whose ranks sum to at most rank_budget; parents first."""
    paths = []
    for depth in range(1, len(branching) + 1):
        for ranks in itertools.product(*(range(b) for b in branching[:depth])):
            if sum(ranks) <= rank_budget:
                paths.append(ranks)
    return paths


@register("recycling")
class TokenRecyclingDrafter(Drafter):
    variants = ({}, {"branching": "2,2,1", "rank_budget": 1, "k": 2})
    tune_grid = ({"branching": "2,1,1", "rank_budget": 1}, {"branching": "2,2,1,1", "rank_budget": 1},
                 {"branching": "4,2,2,1,1,1", "rank_budget": 2}, {"branching": "1,1,1,1"})

    def __init__(self, target, k: int = 8, branching: str = "4,2,2,1,1,1", rank_budget: int = 1):
        widths = tuple(int(b) for b in str(branching).split(","))
        if k < 1 or rank_budget < 0 or not widths or min(widths) < 1 or max(widths) > k:
            raise TypeError("need k >= 1, rank_budget >= 0 and 1 <= each branching width <= k")
        self.template = rank_template(widths, rank_budget)
        self.index = {path: i for i, path in enumerate(self.template)}
        self.max_nodes = len(self.template)
        self.adj = torch.full((target.vocab_size, k), -1, dtype=torch.long)  # [V, k] successor candidates
        self.root = -1  # the last committed token of the current step

    def propose(self, context, params, generator) -> Draft:
        self.root = context[-1]
        tokens, parents = [], []
        node_of: dict[tuple[int, ...], int] = {(): -1}
        token_of: dict[tuple[int, ...], int] = {(): context[-1]}
        for path in self.template:
            parent_path = path[:-1]
            if parent_path not in node_of:  # the parent had no candidate
                continue
            token = int(self.adj[token_of[parent_path], path[-1]])
            if token < 0:
                continue
            node_of[path], token_of[path] = len(tokens), token
            tokens.append(token)
            parents.append(node_of[parent_path])
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def commit(self, verdict, draft, target_logits) -> None:
        node_tokens = torch.cat([torch.tensor([self.root]), draft.tokens])  # [N+1]: the rows of target_logits
        self.adj[node_tokens] = torch.topk(target_logits, self.adj.shape[1], dim=-1).indices
