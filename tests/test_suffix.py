"""The suffix drafter's index and speculation tree on hand-made sequences."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdecode.drafters import Drafter, build_drafter
from specdecode.drafters.ngram_table import read_corpus, suffix_matches
from specdecode.drafters.suffix import speculation_tree
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams
from specdecode.tree import Draft


class NumberTokenizer:
    """Text "5 6 7" -> ids [5, 6, 7]."""

    def __call__(self, texts):
        return {"input_ids": [[int(word) for word in text.split()] for text in texts]}


class FakeTarget:
    name = "fake"
    vocab_size = 64
    tokenizer = NumberTokenizer()
    dtype = torch.float32
    quant = "none"


def propose(drafter, context):
    draft = drafter.propose(context, SamplingParams(), None)
    return draft.tokens.tolist(), draft.parents.tolist()


def test_suffix_matches_lists_every_length_up_to_the_longest():
    ctx = np.array([1, 2, 3, 4, 8, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3])
    levels = suffix_matches(ctx, ctx, 16)
    assert [level.tolist() for level in levels] == [[3, 7, 11], [3, 7, 11], [3, 11]]  # "5 1 2 3" never occurred
    assert len(suffix_matches(ctx, ctx, 2)) == 2
    assert suffix_matches(ctx, np.array([6]), 4) == []
    assert suffix_matches(np.array([3]), np.array([3]), 4) == []  # an occurrence needs a continuation


def test_speculation_tree_keeps_the_most_frequent_nodes():
    continuations = [[1, 9, 7], [1, 9, 7, 2], [2, 9, 7]]
    draft, expected = speculation_tree(continuations, 16, 0.0)  # most frequent first
    assert draft.tokens.tolist() == [1, 9, 7, 2, 2, 9, 7] and draft.parents.tolist() == [-1, 0, 1, 2, -1, 4, 5]
    assert expected == pytest.approx((2 + 2 + 2 + 1 + 1 + 1 + 1) / 3)  # each node's share of the continuations
    draft, expected = speculation_tree(continuations, 16, 0.5)  # "2 ..." is a third of the occurrences
    assert draft.tokens.tolist() == [1, 9, 7] and draft.parents.tolist() == [-1, 0, 1] and expected == 2.0
    draft, _ = speculation_tree(continuations, 4, 0.0)  # 1, 9, 7 (count 2), then the first node of count 1
    assert draft.tokens.tolist() == [1, 9, 7, 2] and draft.parents.tolist() == [-1, 0, 1, 2]
    assert speculation_tree([], 4, 0.0)[1] == 0.0 and speculation_tree([[]], 4, 0.0)[1] == 0.0


def test_longest_match_and_continuation_counts():
    drafter = build_drafter("suffix", FakeTarget(), min_prob=0.0, max_history=0)
    drafter.start([], 32)
    # the suffix "9 7" occurred three times; "2 9 7" never; two continuations start with 1, one with 2
    tokens, parents = propose(drafter, [9, 7, 1, 9, 7, 1, 9, 7, 2, 9, 7])
    assert tokens[0] == 1 and 2 in tokens and parents[tokens.index(2)] == -1
    drafter.start([], 32)
    tokens, parents = propose(drafter, [5, 9, 7, 1, 6, 9, 7, 2, 6, 9, 7, 2, 5, 9, 7])  # the longest match wins
    assert tokens[0] == 1 and 2 not in [t for t, p in zip(tokens, parents) if p == -1]


def test_budget_grows_with_the_match_length():
    drafter = build_drafter("suffix", FakeTarget(), alpha=1.0, max_nodes=5, max_history=0)
    drafter.start([], 64)
    assert propose(drafter, [9, 7, 1, 9, 7, 1, 9, 7, 2, 9, 7]) == ([1, 9], [-1, 0])  # match 2: 2 nodes
    drafter.start([], 64)
    context = [4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]  # match 9: capped at 5 nodes
    assert propose(drafter, context) == ([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3])
    drafter.start([], 64)
    assert propose(drafter, [1, 2, 3]) == ([], [])


def test_context_is_indexed_incrementally():
    drafter = build_drafter("suffix", FakeTarget())
    drafter.start([5, 6], 4)  # capacity too small on purpose: the buffer grows
    assert propose(drafter, [5, 6, 7]) == ([], [])
    assert propose(drafter, [5, 6, 7, 5, 6])[0][:1] == [7]


def test_earlier_outputs_are_a_source():
    drafter = build_drafter("suffix", FakeTarget(), alpha=2.0)
    drafter.start([1], 16)
    propose(drafter, [1, 20, 21, 22, 23])
    drafter.start([2], 16)  # the first request's output 20 21 22 23 joins the history
    assert propose(drafter, [2, 20, 21])[0] == [22, 23]
    fresh = build_drafter("suffix", FakeTarget(), alpha=2.0, max_history=0)
    fresh.start([1], 16)
    propose(fresh, [1, 20, 21, 22, 23])
    fresh.start([2], 16)
    assert propose(fresh, [2, 20, 21]) == ([], [])


def test_corpus_text_and_jsonl(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("30 31 32 33 34")
    drafter = build_drafter("suffix", FakeTarget(), corpus=str(text), alpha=2.0)
    drafter.start([7], 16)
    assert propose(drafter, [7, 31, 32]) == ([33, 34], [-1, 0])
    lines = tmp_path / "corpus.jsonl"
    lines.write_text(json.dumps({"text": "40 41 42"}) + "\n\n" + json.dumps({"turns": ["40 41 43", "44"]}) + "\n")
    assert read_corpus(str(lines), NumberTokenizer()) == [[40, 41, 42], [40, 41, 43, 44]]
    drafter = build_drafter("suffix", FakeTarget(), corpus=str(lines), min_prob=0.0)
    drafter.start([7], 16)
    tokens, parents = propose(drafter, [7, 40, 41])  # two documents: two branches
    assert sorted(t for t, p in zip(tokens, parents) if p == -1) == [42, 43]
    tokens, _ = propose(drafter, [7, 40, 41, 42])  # a continuation stops at the end of its document
    assert tokens == []


def test_bad_jsonl_corpus(tmp_path):
    lines = tmp_path / "corpus.jsonl"
    lines.write_text('{"text": "1 2"}\nnot json\n')
    with pytest.raises(SpecDecodeError, match="line 2 of corpus"):
        build_drafter("suffix", FakeTarget(), corpus=str(lines))


def test_draft_model_hands_long_matches_to_the_suffix_tree():
    from conftest import perturbed_copy, tiny_model

    target = tiny_model("llama", seed=1)
    drafter = build_drafter("draft", target, draft_model=perturbed_copy(target, scale=0.1, seed=2), topk=1, depth=3,
                            lookup=3, lookup_nodes=5)
    assert drafter.name == "draft" and drafter.max_nodes == 5 and drafter.options["lookup"] == 3
    assert drafter.catches_up  # the governor must not judge the draft model's catch-up step (its prefill of skips)
    context = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]
    drafter.start(context, 64)
    draft = drafter.propose(context, SamplingParams(), None)
    assert drafter.looked_up and draft.tokens.tolist() == [8, 9, 10, 11, 12]  # what followed "5 6 7"
    assert drafter.inner.cache.length == 0  # the draft model did not run
    context = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 9]  # "6 7 9" never occurred: the draft model drafts
    draft = drafter.propose(context, SamplingParams(), None)
    assert not drafter.looked_up and len(draft) == 3 and drafter.inner.cache.length == len(context)


class Counting(Drafter):
    """Proposes nothing; counts the commits it sees."""

    name = "counting"

    def __init__(self):
        self.commits = 0

    def propose(self, context, params, generator):
        return Draft.empty()

    def commit(self, verdict, draft, target_logits):
        self.commits += 1


def test_the_lookup_hybrid_wraps_any_drafter_and_commits_only_its_own_drafts():
    from conftest import tiny_model

    from specdecode.drafters.hybrid import LookupHybrid
    from specdecode.engine import generate

    target = tiny_model("llama", seed=1)
    prompt = [3, 9, 4, 17, 3, 9, 4, 22, 3, 9, 4, 17, 3, 9]
    plain, _ = generate(target, build_drafter("none", target), prompt, 30, SamplingParams())
    for name in ("jacobi", "pld"):
        wrapped = build_drafter(name, target, lookup=2, lookup_nodes=6)
        assert isinstance(wrapped, LookupHybrid) and wrapped.name == name and not wrapped.catches_up
        assert generate(target, wrapped, prompt, 30, SamplingParams())[0] == plain
    hybrid = LookupHybrid(Counting(), target, lookup=2)
    tokens, stats = generate(target, hybrid, prompt, 30, SamplingParams())
    assert tokens == plain and stats.drafted_tokens > 0  # the lookup drafted (the inner drafter proposes nothing)
    assert 0 < hybrid.inner.commits < stats.target_forwards - 1  # commits of the inner drafter's own drafts only
