"""StreamingLLM self-speculation (`streaming`): its cache mirrors exactly the target's sinks and recent window, a
window holding the whole context drafts the target itself (every draft token accepted), a narrow window still
decodes what plain decoding does, and below min_context it proposes nothing. TriForce (`triforce`): a whole-window
middle level is the target, and narrow windows on both lower levels still decode what plain decoding does."""

from __future__ import annotations

import torch

from specdecode.drafters import build_drafter
from specdecode.engine import generate
from specdecode.models.base import prefill
from specdecode.sampling import SamplingParams

from conftest import tiny_pair

GREEDY = SamplingParams()
PROMPT = [3, 9, 4, 17, 3, 9, 4, 22, 3, 9, 4, 17]


def test_the_cache_mirrors_the_sinks_and_the_window_ring():
    target, _ = tiny_pair("llama:native-int4")
    cache = target.new_cache(32)
    prefill(target, cache, PROMPT)
    drafter = build_drafter("streaming", target, sinks=2, window=4, depth=2)
    drafter.use_target_cache(cache)
    drafter.start(PROMPT, 32)

    def expect(slots: dict[int, int]):  # own slot -> the target position it must hold
        own = drafter.own
        assert own.length == len(slots)
        for slot, position in slots.items():
            assert torch.equal(own.keys[:, :, :, slot], cache.keys[:, :, :, position])
            assert torch.equal(own.values[:, :, :, slot], cache.values[:, :, :, position])
            assert int(own.positions[slot]) == position

    drafter._mirror(cache.length)  # 12 committed: sinks 0, 1; window 8..11 in ring slots 2 + (p - 2) % 4
    expect({0: 0, 1: 1, 4: 8, 5: 9, 2: 10, 3: 11})
    prefill(target, cache, [5, 6, 7])  # 15 committed: the window moves to 11..14
    drafter._mirror(cache.length)
    expect({0: 0, 1: 1, 3: 11, 4: 12, 5: 13, 2: 14})


def test_a_window_over_the_whole_context_drafts_the_target_itself():
    target, _ = tiny_pair("llama:native-int4")
    plain, _ = generate(target, build_drafter("none", target), PROMPT, 24, GREEDY)
    drafter = build_drafter("streaming", target, window=64, depth=4, length="fixed", min_context=0)
    tokens, stats = generate(target, drafter, PROMPT, 24, GREEDY)
    assert tokens == plain
    assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens  # row-exact: the same logits


def test_a_narrow_window_decodes_what_plain_decoding_does():
    target, _ = tiny_pair("llama:native-int4")
    prompt = PROMPT * 3
    plain, _ = generate(target, build_drafter("none", target), prompt, 30, GREEDY)
    drafter = build_drafter("streaming", target, sinks=1, window=3, depth=3, length="fixed", min_context=0)
    tokens, stats = generate(target, drafter, prompt, 30, GREEDY)
    assert tokens == plain and stats.drafted_tokens > 0 and drafter.own.length == 4


def test_below_min_context_it_proposes_nothing():
    target, _ = tiny_pair("llama:native-int4")
    drafter = build_drafter("streaming", target, min_context=len(PROMPT) + 100)
    _, stats = generate(target, drafter, PROMPT, 12, GREEDY)
    assert stats.drafted_tokens == 0 and stats.new_tokens == 12


def test_triforce_with_a_whole_window_middle_level_is_the_target():
    """With a middle window over the whole context the middle level is the target (row-exact kernels): the full
    target accepts every chain token the middle level kept, whatever the draft model proposed to it."""
    target, draft_model = tiny_pair("llama:native-int4")
    plain, _ = generate(target, build_drafter("none", target), PROMPT, 24, GREEDY)
    drafter = build_drafter("triforce", target, draft_model=draft_model, window=64, depth=5, min_context=0)
    tokens, stats = generate(target, drafter, PROMPT, 24, GREEDY)
    assert tokens == plain
    assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens


def test_triforce_with_narrow_windows_decodes_what_plain_decoding_does():
    target, draft_model = tiny_pair("llama:native-int4")
    prompt = PROMPT * 3
    plain, _ = generate(target, build_drafter("none", target), prompt, 30, GREEDY)
    drafter = build_drafter("triforce", target, draft_model=draft_model, sinks=1, window=3, draft_window=4,
                            depth=4, min_context=0)
    tokens, stats = generate(target, drafter, prompt, 30, GREEDY)
    assert tokens == plain and stats.drafted_tokens > 0 and drafter.own.length == 4
