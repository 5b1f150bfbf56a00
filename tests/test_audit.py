"""The audit passes the real verifiers and catches planted bugs, greedy and sampling."""

from __future__ import annotations

import copy

import torch

from specdecode.audit import audit_greedy, audit_sampling
from specdecode.drafters import build_drafter
from specdecode.models.hf import HFModel
from specdecode.sampling import SamplingParams
from specdecode.verify import GreedyVerifier
from specdecode.verify.base import verdict

from conftest import perturbed_copy, tiny_model
from test_sampling_distribution import WrongResidualVerifier

PROMPTS = [[3, 9, 4, 17, 3, 9, 4, 22, 3, 9], [11, 5, 60, 2, 33, 48, 7, 1]]


class AcceptFirstBranch(GreedyVerifier):
    """A planted bug: accepts the first branch of every draft without looking at the target."""

    def verify(self, draft, target_logits, params, generator):
        accepted, node = [], -1
        for i, parent in enumerate(draft.parents.tolist()):
            if parent == node:
                accepted.append(i)
                node = i
        return verdict(draft, accepted, int(target_logits[node + 1].argmax()))


def test_greedy_audit_passes_real_verifier_and_catches_a_planted_bug():
    target = tiny_model("qwen2", seed=1)
    drafter = build_drafter("draft", target, draft_model=perturbed_copy(target, 0.3, seed=2))
    clean = audit_greedy(target, drafter, PROMPTS, 24)
    assert clean.identical == len(PROMPTS) and not clean.divergences
    broken = audit_greedy(target, drafter, PROMPTS, 24, verifier=AcceptFirstBranch())
    assert broken.bugs and broken.bugs[0].kind == "bug"


def test_greedy_audit_calls_a_flipped_near_tie_a_tie():
    target = tiny_model("llama", seed=4)
    drafter = build_drafter("pld", target)
    report = audit_greedy(target, drafter, PROMPTS[:1], 16, tie_margin=float("inf"), verifier=AcceptFirstBranch())
    # with an unlimited margin, a divergence to plain decoding's runner-up counts as a tie, any other as a bug
    for d in report.divergences:
        assert d.kind == ("near-tie" if d.speculative_token == d.runner_up or d.plain_token == d.runner_up else "bug")


def sharpened_copy(target: HFModel, factor: float) -> HFModel:
    """A draft model that puts almost all its mass on the target's argmax: a wrong residual then shows."""
    model = copy.deepcopy(target.model)
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return HFModel(model, target.tokenizer, target.name + "-sharp")


def test_sampling_audit_passes_real_verifier_and_catches_a_wrong_residual():
    target = tiny_model("llama", seed=5, vocab=8, layers=1, hidden=16, initializer_range=0.3)
    drafter = build_drafter("draft", target, draft_model=sharpened_copy(target, 8.0), topk=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0)
    assert audit_sampling(target, drafter, prompt, params, samples=3000).passed
    wrong = audit_sampling(target, drafter, prompt, params, samples=3000, verifier=WrongResidualVerifier())
    assert not wrong.passed, (wrong.tv, wrong.bound)
    assert torch.isfinite(torch.tensor(wrong.tv))
