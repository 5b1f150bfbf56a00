"""The draft model's context window (drafters/draft_model.py, `window=W`): its cache holds the context's first
SINKS tokens and its last W ones, at their cache positions, and catches up by at most W tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_pair
from specdecode.drafters import build_drafter
from specdecode.drafters.draft_model import SINKS
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=1.0)
CONTEXT = [(7 * i + 3) % 61 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def pair():
    # int4 weights on the row-exact kernels: a row's numbers do not depend on how many rows a forward holds, so the
    # window's two prefills (sinks, then the last tokens) give the bits of one prefill of the same tokens. With dense
    # float weights torch's kernels may block 4 + 8 rows differently from 12 (they do on an AMD EPYC).
    return tiny_pair("llama:native-int4")


def sampled_draft(drafter, context, seed: int = 0):
    return drafter.propose(context, SAMPLED, torch.Generator().manual_seed(seed))


def assert_same_draft(draft, reference):
    assert torch.equal(draft.tokens, reference.tokens) and torch.equal(draft.parents, reference.parents)
    assert torch.equal(draft.draft_probs, reference.draft_probs)  # every level's distribution, not only its sample


def whole_context_draft(pair, context, **options):
    """The draft of a window-less drafter given only `context`."""
    target, draft_model = pair
    reference = build_drafter("draft", target, draft_model, **options)
    reference.start(context, 64)
    return sampled_draft(reference, context)


def test_a_windowed_draft_reads_the_sinks_and_the_last_tokens_as_if_they_were_the_whole_context(pair):
    target, draft_model = pair
    drafter = build_drafter("draft", target, draft_model, window=8, depth=3, topk=2, budget=5)
    drafter.start(CONTEXT, 64)
    draft = sampled_draft(drafter, CONTEXT)
    kept = CONTEXT[:SINKS] + CONTEXT[-8:]
    assert drafter.cache.length == len(kept)  # the draft model never read the 28 tokens between
    assert_same_draft(draft, whole_context_draft(pair, kept, depth=3, topk=2, budget=5))
    full = whole_context_draft(pair, CONTEXT, depth=3, topk=2, budget=5)
    assert not torch.equal(draft.draft_probs, full.draft_probs)  # the window did change what the draft model saw


def test_a_windowed_draft_catches_up_token_by_token_and_rewindows_after_a_long_gap(pair):
    target, draft_model = pair
    drafter = build_drafter("draft", target, draft_model, window=8, depth=2, topk=1)
    drafter.start(CONTEXT, 96)
    sampled_draft(drafter, CONTEXT)
    grown = CONTEXT + [5, 6, 7]  # three tokens accepted since: read one by one, nothing more skipped
    draft = sampled_draft(drafter, grown)
    assert drafter.cache.length == SINKS + 8 + 3
    assert_same_draft(draft, whole_context_draft(pair, CONTEXT[:SINKS] + grown[-11:], depth=2, topk=1))
    rested = grown + [(3 * i + 1) % 61 + 1 for i in range(30)]  # a long stretch decoded without the drafter
    draft = sampled_draft(drafter, rested)
    assert drafter.cache.length == SINKS + 8
    assert_same_draft(draft, whole_context_draft(pair, rested[:SINKS] + rested[-8:], depth=2, topk=1))


def test_a_negative_window_is_refused(pair):
    target, draft_model = pair
    with pytest.raises(SpecDecodeError, match="window >= 0"):
        build_drafter("draft", target, draft_model, window=-1)
