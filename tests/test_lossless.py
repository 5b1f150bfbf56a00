"""Every registered drafter, in every variant it declares, is token-identical to plain greedy decoding (float32).
Drafters that take a draft model of another tokenizer (foreign_vocabulary) get one: the tiny target then speaks a
byte-level BPE vocabulary and the draft model another (conftest.foreign_tokenizers)."""

from __future__ import annotations

import pytest

from specdecode.drafters import DRAFTERS, build_drafter
from specdecode.engine import generate
from specdecode.sampling import SamplingParams
from specdecode.text import chat_prompt_ids

from conftest import TARGETS, perturbed_copy, tiny_foreign_pair, tiny_pair as make_tiny_pair

CASES = [(name, variant) for name, cls in sorted(DRAFTERS.items()) for variant in cls.variants]
IDS = [f"{name}{variant or ''}" for name, variant in CASES]
GREEDY = SamplingParams()


def make_drafter(name, variant, target, draft_model):
    options = dict(variant)
    if DRAFTERS[name].needs_draft_model:
        options["draft_model"] = draft_model
    return build_drafter(name, target, **options)


@pytest.fixture(scope="module", params=TARGETS)
def target_spec(request):
    return request.param


@pytest.fixture(scope="module")
def tiny_pair(target_spec):
    return make_tiny_pair(target_spec, seed=1)


@pytest.fixture(scope="module")
def foreign_pair(target_spec):
    return tiny_foreign_pair(target_spec, seed=1)


def pair_for(request, name: str):
    """(target, draft model) for a drafter: a draft model of another tokenizer when the drafter takes one."""
    return request.getfixturevalue("foreign_pair" if DRAFTERS[name].foreign_vocabulary else "tiny_pair")


PROMPTS = [
    [3, 9, 4, 17, 3, 9, 4, 22, 3, 9, 4, 17, 3, 9],  # repetitive: lookups hit
    [11, 5, 60, 2, 33, 48, 7, 1, 19, 50, 41, 13],
]


@pytest.mark.parametrize("name,variant", CASES, ids=IDS)
def test_tiny_models_greedy_identical_to_plain(request, target_spec, name, variant):
    target, draft_model = pair_for(request, name)
    accepted = 0
    for prompt in PROMPTS:
        plain, plain_stats = generate(target, build_drafter("none", target), prompt, 40, GREEDY)
        drafter = make_drafter(name, variant, target, draft_model)
        spec, stats = generate(target, drafter, prompt, 40, GREEDY)
        assert spec == plain
        assert stats.new_tokens == 40 and plain_stats.target_forwards == 40
        assert stats.target_forwards == len(stats.accepted_per_step) + 1
        accepted += stats.accepted_tokens
    if drafter.max_nodes:  # the comparison must have exercised accepted drafts, not only rejections
        assert accepted > 0


REAL_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and an example.",
    "Summarize: The cat sat on the mat. The cat was happy on the mat because the mat was warm and soft.",
]


@pytest.mark.real_model
@pytest.mark.parametrize("name,variant", CASES, ids=IDS)
def test_smollm2_greedy_identical_to_plain(smollm2, smollm2_draft, smollm2_prompts, name, variant):
    for prompt in smollm2_prompts:
        plain, _ = generate(smollm2, build_drafter("none", smollm2), prompt, 48, GREEDY)
        spec, _ = generate(smollm2, make_drafter(name, variant, smollm2, smollm2_draft), prompt, 48, GREEDY)
        assert spec == plain


@pytest.fixture(scope="module")
def smollm2_draft(smollm2):
    return perturbed_copy(smollm2, scale=0.05, seed=3)


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2):
    return [chat_prompt_ids(smollm2.tokenizer, [{"role": "user", "content": p}]) for p in REAL_PROMPTS]
