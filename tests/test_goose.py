"""Goose: a prompt-lookup spine with Token Recycling branches; the pure recycling tree when the lookup fails."""

from __future__ import annotations

import torch

from specdecode.drafters import build_drafter
from specdecode.sampling import SamplingParams


class FakeTarget:
    vocab_size = 16


def goose(**options):
    drafter = build_drafter("goose", FakeTarget(), k=2, **{"fallback": "2,1", **options})
    drafter.adj[:] = torch.tensor([[(t + 1) % 16, (t + 2) % 16] for t in range(16)])  # successors t+1, t+2
    return drafter


def propose(drafter, context):
    draft = drafter.propose(context, SamplingParams(), None)
    return draft.tokens.tolist(), draft.parents.tolist()


def test_spine_first_then_branches_from_the_root_down():
    drafter = goose(spine=3, branching="1", max_nodes=16)
    # lookup: "9" occurred before, followed by 3 5 7; recycling proposes t+1 below each token
    tokens, parents = propose(drafter, [9, 3, 5, 7, 9])
    assert tokens[:3] == [3, 5, 7] and parents[:3] == [-1, 0, 1]  # the spine
    assert list(zip(tokens[3:], parents[3:])) == [(10, -1), (4, 0), (6, 1), (8, 2)]  # a branch below each node
    tokens, parents = propose(goose(spine=3, branching="1", max_nodes=5), [9, 3, 5, 7, 9])
    assert tokens == [3, 5, 7, 10, 4] and parents == [-1, 0, 1, -1, 0]  # budget spent from the root down


def test_branch_tokens_equal_to_the_spine_merge_into_it():
    drafter = goose(spine=2, branching="2", max_nodes=16)
    tokens, parents = propose(drafter, [9, 10, 12, 9])  # spine 10 12; below 9 recycling says 10, 11
    assert tokens.count(10) == 1 and (11, -1) in zip(tokens, parents)


def test_no_lookup_falls_back_to_the_recycling_tree():
    drafter = goose(fallback="2,1", max_nodes=16)
    recycling = build_drafter("recycling", FakeTarget(), k=2, branching="2,1")
    recycling.adj[:] = drafter.adj
    assert propose(drafter, [1, 2, 3]) == propose(recycling, [1, 2, 3])
    assert len(goose(fallback="2,2,2", max_nodes=3).propose([1, 2, 3], SamplingParams(), None)) == 3
