import torch

from specdecode.tree import Draft, ancestor_mask, children, depths, from_sequences, path_to, with_root


def test_chain_is_a_tree_with_one_branch():
    d = Draft.chain([5, 6, 7])
    assert d.parents.tolist() == [-1, 0, 1]
    assert depths(d.parents).tolist() == [1, 2, 3]


def test_ancestor_mask_and_positions_of_a_tree():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    parents = torch.tensor([-1, -1, 0, 0, 1])
    mask = ancestor_mask(with_root(parents))  # [6, 6] over [root, 0..4]
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert (depths(with_root(parents)) - 1).tolist() == [0, 1, 1, 2, 2, 2]  # position offsets
    assert children(parents) == [[2, 3], [4], [], [], []]
    assert path_to(parents.tolist(), 4) == [1, 4]


def test_from_sequences_merges_shared_prefixes():
    d = from_sequences([[1, 2, 3], [1, 2, 4], [5]])
    assert d.tokens.tolist() == [1, 2, 3, 4, 5]
    assert d.parents.tolist() == [-1, 0, 1, 1, -1]


def test_depth_limited_keeps_an_ancestor_closed_subtree():
    d = Draft(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 2, 1]), torch.rand(5, 3))
    cut = d.depth_limited(2)
    assert cut.tokens.tolist() == [10, 11, 12, 14]
    assert cut.parents.tolist() == [-1, -1, 0, 1]
    assert torch.equal(cut.draft_probs, d.draft_probs[[0, 1, 2, 4]])
    assert len(d.depth_limited(0)) == 0


def test_parents_must_precede_children():
    import pytest

    with pytest.raises(ValueError):
        Draft(torch.tensor([1, 2]), torch.tensor([1, -1]))
