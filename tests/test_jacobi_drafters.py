"""Bookkeeping of the drafters that read the target's logits at their own nodes (lookahead, jacobi, esp): tree
layout, window shifts, n-gram harvest, the maximal coupling, probe nodes, and sampling exactness at later steps
(whose drafts were built from earlier target logits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdecode.drafters import build_drafter
from specdecode.drafters.esp import best_paths
from specdecode.drafters.jacobi import coupled_draw
from specdecode.models.base import forward_tree, prefill
from specdecode.sampling import SamplingParams
from specdecode.tree import PROBE, Draft, depths, trie
from specdecode.verify import GreedyVerifier, RejectionVerifier, Verdict

from conftest import native_twin, tiny_model
from test_sampling_distribution import (
    ALPHA, EXACT, chi_square_p_value, engine_counts, exact_joint, joint_counts, prefix_logits, tv, tv_bound,
)

V = 50
FAKE_TARGET = SimpleNamespace(eos_token_ids=frozenset({49}), vocab_size=V)
GREEDY = SamplingParams()


def logits_with_argmax(tokens: list[int]) -> torch.Tensor:
    """[len, V] logits whose row i has its argmax at tokens[i]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_trie_reports_the_node_of_every_token():
    merged = trie([[1, 2, 3], [1, 2, 4], [5]])
    draft, nodes = merged.draft(), merged.paths
    assert draft.tokens.tolist() == [1, 2, 3, 4, 5]
    assert nodes == [[0, 1, 2], [0, 1, 3], [4]]


def lookahead(**options):
    drafter = build_drafter("lookahead", FAKE_TARGET, **options)
    drafter.start(list(range(10, 20)), 64)
    return drafter


def test_lookahead_window_is_a_spine_with_one_column_per_position():
    drafter = lookahead(window=3, level=4, guess=0)
    drafter.levels = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # levels[l][j] guesses offset j + l
    draft = drafter.propose([10, 11, 12], GREEDY, None)
    tokens, depth = draft.tokens.tolist(), depths(draft.parents).tolist()
    at = {(l, j): node for l, row in enumerate(drafter.nodes) for j, node in enumerate(row)}
    assert at[0, 0] == -1  # column 0 of level 0 is the root (token 12)
    for l, row in enumerate(drafter.levels):
        for j in range(1 if l == 0 else 0, 3):
            assert tokens[at[l, j]] == row[j] and depth[at[l, j]] == j + l
    assert int(draft.parents[at[2, 1]]) == at[1, 1] and int(draft.parents[at[1, 1]]) == at[0, 1]
    assert int(draft.parents[at[1, 0]]) == -1
    assert len(draft) == 2 + 3 * 2 == drafter.max_nodes


def test_lookahead_harvests_trajectories_and_shifts_by_the_accepted_length():
    drafter = lookahead(window=3, level=3, guess=2, pool_from_context=False)
    drafter.levels = [[0, 1, 2], [3, 4, 5]]
    draft = drafter.propose([10, 11, 12], GREEDY, None)
    rows = [0] * (len(draft) + 1)
    for j, node in enumerate(drafter.nodes[-1]):
        rows[node + 1] = 30 + j  # the target's guesses one level up: offsets 2, 3, 4
    accepted = Verdict([0], [1], 7)  # spine node 0 accepted: the root moves 2 positions
    drafter.commit(accepted, draft, logits_with_argmax(rows))
    assert drafter.pool.lookup([12], 5) == [[3, 30]]
    assert drafter.pool.lookup([1], 5) == [[4, 31]] and drafter.pool.lookup([2], 5) == [[5, 32]]
    # Levels moved down one and left by one more column (shift 2 = accepted + bonus, minus the level move).
    assert drafter.levels[0][1:2] == [5] and drafter.levels[1][:2] == [31, 32]


def test_lookahead_warm_up_fills_levels_then_drafts_pool_candidates():
    drafter = lookahead(window=3, level=3, guess=1, pool_from_context=False)
    assert len(drafter.levels) == 1
    draft = drafter.propose([10, 11, 12], GREEDY, None)
    drafter.commit(Verdict([], [], 7), draft, logits_with_argmax([20, 21, 22] + [0] * (len(draft) - 2)))
    assert drafter.levels[1][:2] == [21, 22]  # warm-up: shift one, add the level
    draft = drafter.propose([10, 11, 12, 7], GREEDY, None)
    drafter.commit(Verdict([], [], 8), draft, logits_with_argmax([5] * (len(draft) + 1)))
    assert len(drafter.levels) == 2 and drafter.pool.lookup([7], 1) == [[21, 5]]


def test_lookahead_replaces_end_of_sequence_guesses():
    drafter = lookahead(window=2, level=2, guess=0)
    draft = drafter.propose([10, 11], GREEDY, None)
    drafter.commit(Verdict([], [], 3), draft, logits_with_argmax([49, 49]))
    assert 49 not in drafter.levels[0]


def test_jacobi_window_shifts_past_the_accepted_tokens():
    drafter = build_drafter("jacobi", FAKE_TARGET, window=4)
    drafter.start([10, 11], 64)
    draft = drafter.propose([10, 11], GREEDY, None)
    guesses = draft.tokens.tolist()
    drafter.commit(Verdict([0], guesses[:1], 7), draft, logits_with_argmax([guesses[0], 7, 20, 21, 22]))
    assert drafter.tokens == guesses[2:] + [None]  # old positions 2, 3 and one new one
    draft = drafter.propose([10, 11, guesses[0], 7], GREEDY, None)
    assert draft.tokens.tolist()[:3] == [20, 21, 22]  # greedy: plain Jacobi, the target's argmax
    assert len(draft) == 4


def test_maximal_coupling_samples_the_target_and_keeps_the_old_guess_when_it_can():
    gen = torch.Generator().manual_seed(0)
    draft_row = torch.tensor([0.5, 0.3, 0.2, 0.0])
    target_probs = torch.tensor([0.1, 0.3, 0.4, 0.2])
    n, counts, kept = 20000, torch.zeros(4), 0
    for _ in range(n):
        old = int(torch.multinomial(draft_row, 1, generator=gen))
        new = coupled_draw(old, draft_row, target_probs, gen)
        counts[new] += 1
        kept += new == old
    assert tv(counts, target_probs) < tv_bound(4, n)
    assert kept / n == pytest.approx(1 - 0.5 * float((draft_row - target_probs).abs().sum()), abs=0.02)


def test_esp_tree_keeps_the_best_paths_of_the_probes_guesses():
    depth_logits = torch.tensor([[3.0, 2.0, 0.0], [0.0, 3.0, 2.5]]).log_softmax(-1)  # [D=2, V=3]
    assert best_paths(depth_logits, topk=2, budget=3) == [[0], [1], [0, 1]]
    assert best_paths(torch.zeros(0), topk=2, budget=3) == []


def test_a_probe_is_never_accepted_and_leaves_sampling_exact():
    probe_first = Draft(torch.tensor([PROBE, 0, 3, 2]), torch.tensor([-1, -1, 1, 0]))
    logits = torch.zeros(5, 5)
    logits[0, 0] = logits[1, 0] = 10.0
    assert GreedyVerifier().verify(probe_first, logits, GREEDY, None).accepted == [1]
    n = 20000
    assert tv(joint_counts(lambda gen: probe_first, RejectionVerifier(), n), EXACT) < tv_bound(25, n)


def test_a_probe_with_a_tokens_embedding_reads_like_that_token():
    target = tiny_model("qwen2", seed=3)
    prompt = [5, 6, 7]
    cache = target.new_cache(16)
    prefill(target, cache, prompt)
    as_token = forward_tree(target, cache, 8, Draft.chain([9, 10]))
    cache.discard()
    probe = Draft(torch.tensor([9, PROBE]), torch.tensor([-1, 0]), probe_embedding=target.embed(torch.tensor([10]))[0])
    assert torch.allclose(forward_tree(target, cache, 8, probe), as_token, atol=1e-5)


@pytest.mark.parametrize(
    "name,options", [("jacobi", {"window": 3}), ("lookahead", {"window": 3}), ("esp", {"probes": 3, "budget": 4})]
)
def test_later_steps_sample_exactly(name, options):
    """Tokens 3 and 4 come from steps whose drafts were built from earlier target logits (coupled guesses)."""
    vocab = 6
    target = native_twin(tiny_model("llama", seed=5, vocab=vocab, layers=1, hidden=16, initializer_range=0.6))
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(prefix_logits(target, prompt, 4), params, vocab, 4).sum((0, 1))  # [V, V]: tokens 2 and 3
    drafter = build_drafter(name, target, **options)
    counts, _, _ = engine_counts(target, drafter, prompt, params, vocab, 2, 2000, at=2)
    assert chi_square_p_value(counts, exact) > ALPHA
