"""Token Recycling (Luo et al., 2024): recycle the target's own top-k candidates as a next-token table.

An adjacency table adj[token] holds the k most likely successors the target predicted after `token` the last time
it saw it; every node of every verified tree updates it, accepted or not. A draft is a static tree of candidate
ranks expanded breadth-first from the last committed token. Deterministic drafts (draft_probs None), so sampling
uses the point-mass rule. The table lives as long as the drafter (across requests), as in the paper.
"""

from __future__ import annotations

import itertools

import torch

from ..errors import OptionError
from ..tree import Draft, from_sequences
from .base import Drafter, register


def rank_template(branching: tuple[int, ...], rank_budget: int) -> list[tuple[int, ...]]:
    """Rank paths (r1..rd), r_i < branching[i-1], whose ranks sum to at most rank_budget; parents first."""
    paths = []
    for depth in range(1, len(branching) + 1):
        for ranks in itertools.product(*(range(b) for b in branching[:depth])):
            if sum(ranks) <= rank_budget:
                paths.append(ranks)
    return paths


def parse_template(branching: str, k: int, rank_budget: int) -> list[tuple[int, ...]]:
    """The rank template of a "4,2,1"-style option (widths by depth) over a table of k candidates per token."""
    widths = tuple(int(b) for b in str(branching).split(","))
    if k < 1 or rank_budget < 0 or not widths or min(widths) < 1 or max(widths) > k:
        raise OptionError("need k >= 1, rank_budget >= 0 and 1 <= each branching width <= k")
    return rank_template(widths, rank_budget)


@register("recycling")
class TokenRecyclingDrafter(Drafter):
    variants = ({}, {"branching": "2,2,1", "rank_budget": 1, "k": 2})
    tune_grid = ({"branching": "2,1,1", "rank_budget": 1}, {"branching": "2,2,1,1", "rank_budget": 1},
                 {"branching": "4,2,2,1,1,1", "rank_budget": 2}, {"branching": "1,1,1,1"})

    def __init__(self, target, k: int = 8, branching: str = "4,2,2,1,1,1", rank_budget: int = 1):
        self.template = parse_template(branching, k, rank_budget)
        self.max_nodes = len(self.template)
        self.adj = torch.full((target.vocab_size, k), -1, dtype=torch.long)  # [V, k] successor candidates
        self.root = -1  # the last committed token of the current step

    def propose(self, context, params, generator) -> Draft:
        self.root = context[-1]
        return from_sequences(self.recycled_paths(context[-1], self.template))

    def recycled_paths(self, token: int, template: list[tuple[int, ...]]) -> list[list[int]]:
        """The token path below `token` of each rank path in `template` that the table can fill, in template order."""
        paths: dict[tuple[int, ...], list[int]] = {(): []}
        for ranks in template:
            parent = paths.get(ranks[:-1])
            if parent is None:  # the parent had no candidate
                continue
            successor = int(self.adj[parent[-1] if parent else token, ranks[-1]])
            if successor >= 0:
                paths[ranks] = parent + [successor]
        return list(paths.values())[1:]

    def commit(self, verdict, draft, target_logits) -> None:
        node_tokens = torch.cat([torch.tensor([self.root]), draft.tokens])  # [N+1]: the rows of target_logits
        self.adj[node_tokens] = torch.topk(target_logits, self.adj.shape[1], dim=-1).indices
