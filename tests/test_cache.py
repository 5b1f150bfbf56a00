import torch

from specdecode.cache import KVCache
from specdecode.models.base import attention_mask


def filled_cache(n_committed: int, n_pending: int) -> KVCache:
    cache = KVCache(n_layers=2, n_kv_heads=1, head_dim=1, capacity=32, dtype=torch.float32)
    for start, count in ((0, n_committed), (n_committed, n_pending)):
        if count == 0:
            continue
        values = torch.arange(start, start + count, dtype=torch.float32).view(1, 1, count, 1)
        cache.reserve(torch.arange(start, start + count))
        for layer in range(2):
            cache.update(layer, values * (layer + 1), -values)
        cache.advance(count)
        if start == 0:
            cache.commit_all()
    return cache


def test_keep_moves_the_accepted_path_into_place():
    cache = filled_cache(4, 5)  # committed 0..3, uncommitted entries hold 4..8
    cache.keep([0, 2, 4])  # root, then tree nodes at offsets 2 and 4
    assert (cache.length, cache.end) == (7, 7)
    assert cache.keys[0, 0, 0, :7, 0].tolist() == [0, 1, 2, 3, 4, 6, 8]
    assert cache.keys[1, 0, 0, :7, 0].tolist() == [0, 2, 4, 6, 8, 12, 16]
    assert cache.values[0, 0, 0, :7, 0].tolist() == [0, -1, -2, -3, -4, -6, -8]
    assert cache.positions[:7].tolist() == list(range(7))


def test_repeat_to_fills_a_long_timing_context_with_copies():
    cache = filled_cache(3, 0)
    cache.repeat_to(8)
    assert (cache.length, cache.end) == (8, 8)
    assert cache.keys[1, 0, 0, :8, 0].tolist() == [0, 2, 4, 0, 2, 4, 0, 2]
    assert cache.values[0, 0, 0, :8, 0].tolist() == [0, -1, -2, 0, -1, -2, 0, -1]
    assert cache.positions[:8].tolist() == list(range(8))


def test_truncate_and_discard_are_o1_rollbacks():
    cache = filled_cache(6, 3)
    cache.discard()
    assert (cache.length, cache.end) == (6, 6)
    cache.truncate(2)
    assert (cache.length, cache.end) == (2, 2)


def test_attention_mask_sees_committed_entries_and_the_tree():
    cache = filled_cache(3, 0)
    tree = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    cache.reserve(torch.tensor([3, 4]))
    assert attention_mask(cache, 2, tree).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # a window of 2 positions hides keys 2+ positions behind the query
    assert attention_mask(cache, 2, tree, window=2).int().tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
