"""Every registered drafter, in every variant it declares, is token-identical to plain greedy decoding (float32).
Drafters that take a draft model of another tokenizer (foreign_vocabulary) get one: the tiny target then speaks a
byte-level BPE vocabulary and the draft model another (conftest.foreign_tokenizers)."""

from __future__ import annotations

import pytest

from specdecode.drafters import DRAFTERS, build_drafter
from specdecode.drafters.base import Drafter
from specdecode.engine import generate
from specdecode.sampling import SamplingParams
from specdecode.text import chat_prompt_ids
from specdecode.tree import Draft

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
# Further prompts, run while a drafter has had no draft accepted on those above (a tiny random model's answer may
# give a drafter nothing to guess): a comparison must exercise accepted drafts, not only rejections.
MORE_PROMPTS = [[3, 9, 4, 17] * 4, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]


@pytest.mark.parametrize("name,variant", CASES, ids=IDS)
def test_tiny_models_greedy_identical_to_plain(request, target_spec, name, variant):
    target, draft_model = pair_for(request, name)
    if DRAFTERS[name].needs_sublayers and not target.runs_sublayers:
        pytest.skip("self-speculation runs a part of the target: native backend only (test_self_spec: the error)")
    accepted = 0
    for i, prompt in enumerate(PROMPTS + MORE_PROMPTS):
        if i >= len(PROMPTS) and (accepted or not drafter.max_nodes):
            break
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


# Real weights: every drafter with its defaults (the tiny models above run every variant on every architecture).
DEFAULT_CASES = [(name, cls.variants[0]) for name, cls in sorted(DRAFTERS.items())]
DEFAULT_IDS = [f"{name}{variant or ''}" for name, variant in DEFAULT_CASES]


@pytest.mark.real_model
@pytest.mark.parametrize("name,variant", DEFAULT_CASES, ids=DEFAULT_IDS)
def test_smollm2_greedy_identical_to_plain(smollm2, smollm2_draft, smollm2_prompts, smollm2_plain, name, variant):
    for prompt, plain in zip(smollm2_prompts, smollm2_plain):
        spec, _ = generate(smollm2, make_drafter(name, variant, smollm2, smollm2_draft), prompt, 48, GREEDY)
        assert spec == plain


@pytest.fixture(scope="module")
def smollm2_draft(smollm2):
    return perturbed_copy(smollm2, scale=0.05, seed=3)


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2):
    return [chat_prompt_ids(smollm2.tokenizer, [{"role": "user", "content": p}]) for p in REAL_PROMPTS]


@pytest.fixture(scope="module")
def smollm2_plain(smollm2, smollm2_prompts):
    """Plain greedy decoding's 48 tokens for each prompt, computed once for the whole matrix."""
    return [generate(smollm2, build_drafter("none", smollm2), prompt, 48, GREEDY)[0] for prompt in smollm2_prompts]


class ReplayDrafter(Drafter):
    """Drafts a known continuation: the next `depth` tokens of `script` after what was generated so far."""

    name = "replay"

    def __init__(self, prompt_len: int, script: list[int], depth: int):
        self.prompt_len, self.script, self.depth = prompt_len, script, depth
        self.max_nodes = depth

    def propose(self, context, params, generator) -> Draft:
        done = len(context) - self.prompt_len
        return Draft.chain(self.script[done : done + self.depth])


def test_end_of_sequence_inside_an_accepted_draft_stops_exactly_there():
    target, _ = make_tiny_pair("qwen2:native", seed=1)
    prompt = PROMPTS[1]
    script, _ = generate(target, build_drafter("none", target), prompt, 24, GREEDY)  # no end-of-sequence id yet
    stop = next(i for i in range(3, len(script)) if script[i] not in script[:i])  # its first occurrence ends it
    target.eos_token_ids = frozenset({script[stop]})
    plain, plain_stats = generate(target, build_drafter("none", target), prompt, 24, GREEDY)
    assert plain == script[: stop + 1] and plain_stats.finish_reason == "stop"
    # drafts run 6 tokens ahead of the script, so one accepted draft carries the end-of-sequence token and more
    spec, stats = generate(target, ReplayDrafter(len(prompt), script, 6), prompt, 24, GREEDY)
    assert spec == plain and stats.finish_reason == "stop" and stats.new_tokens == stop + 1
    assert stats.accepted_tokens + stats.target_forwards > stats.new_tokens  # tokens past it were accepted, then cut


@pytest.mark.real_model
def test_draft_quant_changes_the_draft_model_only(smollm2, monkeypatch, capsys):
    """--draft-quant int4: the draft model's weights are int4, the target's float32, the output plain decoding's."""
    import json

    from specdecode import api
    from specdecode.cli import main

    loaded = []
    load = api.load_model
    monkeypatch.setattr(api, "load_model", lambda *args: loaded.append(args[3]) or load(*args))
    assert main(["generate", "--model", "smollm2-135m-instruct", "--drafter", "draft", "--draft-model",
                 "smollm2-135m-instruct", "--draft-quant", "int4", "-o", "topk=1", "-o", "depth=4", "--dtype",
                 "float32", "--chat", "--prompt", REAL_PROMPTS[0], "--max-new-tokens", "32", "--compare",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert loaded[:2] == ["auto", "int4"]  # target, then draft model (--compare loads plain decoding after)
    assert out["identical"] is True
    assert out["speculative"]["acceptance_rate"] > 0.5  # int4 weights of the same model mostly agree with it
