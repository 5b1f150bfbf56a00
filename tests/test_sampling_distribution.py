"""Speculative sampling must reproduce the target's sampling distribution exactly.

Verifier level: a synthetic target p(x1), p(x2 | x1) over a 5-token vocabulary; three draft kinds (a chain sampled
from q, a tree sampled without replacement, a deterministic tree); the empirical joint distribution of the first
two tokens over 20,000 draws must lie within a total-variation bound that holds with probability 1 - 1e-4
(Bretagnolle-Huber-Carol: P(TV > eps) <= 2^K exp(-2 n eps^2)). A verifier with a wrong residual, or one that
accepts with p(x) instead of min(1, p(x) / q(x)), must fail it.
Engine level: the same check end to end on tiny models, for every drafter that supports sampling at every sampling
setting (T=1, T=0.7, top-k, top-p), with chi-square tests sized by a power computation (tests/power.py), each
case asserting that its drafts were accepted at depth 3, and planted bugs (in the acceptance rule, the residual,
block verification's stops, the draft distribution, the tree mask, the foreign-vocabulary proposals) that each
fail the test at the matrix's own sample count. The module's false-failure rate is computed at its end.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from specdecode.drafters import DRAFTERS, build_drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.slrs import SLRSDrafter
from specdecode.drafters.tli import TLIDrafter
from specdecode.engine import generate
from specdecode.sampling import SamplingParams, probs_from_logits, sample
from specdecode.tree import Draft, depths
from specdecode.verify import RejectionVerifier, block, rejection
from specdecode.verify.rejection import residual
from specdecode.verify.base import verdict

from conftest import bpe_tokenizer, native_twin, perturbed_copy, tiny_model
from power import chi_square_survival, power, samples_for

V = 5
P0 = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])  # target at the root
P1 = torch.softmax(torch.tensor([[1.5, 0.2, -1.0, 0.3, 0.0]]) + torch.arange(V)[:, None] * torch.tensor([0.0, 0.5, 1.0, -0.5, 0.2]), -1)  # [V, V]: p(x2 | x1)
Q0 = torch.tensor([0.05, 0.15, 0.2, 0.3, 0.3])  # draft at the root: far from P0
Q1 = torch.roll(P1, 1, dims=1) * 0.5 + 0.1  # [V, V]: draft of x2 given x1
Q1 = Q1 / Q1.sum(-1, keepdim=True)
EXACT = P0[:, None] * P1  # [V, V] joint of the first two tokens


def tv_bound(cells: int, n: int, delta: float = 1e-4) -> float:
    return math.sqrt((cells * math.log(2) + math.log(1 / delta)) / (2 * n))


def tv(counts: torch.Tensor, exact: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - exact).abs().sum())


def target_logits_for(draft: Draft) -> torch.Tensor:
    """[N+1, V] logits of the synthetic target: root, then each node (depth-2 rows are never read for x2)."""
    rows = [P0.log()]
    for token, parent in zip(draft.tokens.tolist(), draft.parents.tolist()):
        rows.append(P1[token].log() if parent < 0 else torch.zeros(V))
    return torch.stack(rows)


def sampled_chain(gen) -> Draft:
    x1 = sample(Q0, gen)
    x2 = sample(Q1[x1], gen)
    return Draft.chain([x1, x2], torch.stack([Q0, Q1[x1]]))


def sampled_tree(gen) -> Draft:
    """Two root children drawn without replacement, each extended by one sampled child."""
    first = sample(Q0, gen)
    q_second = Q0.clone()
    q_second[first] = 0
    q_second /= q_second.sum()
    second = sample(q_second, gen)
    c1, c2 = sample(Q1[first], gen), sample(Q1[second], gen)
    probs = torch.stack([Q0, q_second, Q1[first], Q1[second]])
    return Draft(torch.tensor([first, second, c1, c2]), torch.tensor([-1, -1, 0, 1]), probs)


def deterministic_tree(gen) -> Draft:
    return Draft(torch.tensor([0, 3, 2, 0, 1]), torch.tensor([-1, -1, 0, 0, 1]))


class WrongResidualVerifier(RejectionVerifier):
    """A planted bug: after a rejection, sample from the unchanged target distribution."""

    def verify(self, draft, target_logits, params, generator):
        from specdecode.tree import children, with_root

        kids = children(with_root(draft.parents))
        node, accepted = 0, []
        while True:
            p = probs_from_logits(target_logits[node], params)
            for child in kids[node]:
                token = int(draft.tokens[child - 1])
                q = 1.0 if draft.draft_probs is None else float(draft.draft_probs[child - 1][token])
                if float(torch.rand((), generator=generator)) * q < float(p[token]):
                    accepted.append(child - 1)
                    node = child
                    break
            else:
                return verdict(draft, accepted, sample(p, generator))


def joint_counts(make_draft, verifier, n: int = 20000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(V, V)
    for _ in range(n):
        draft = make_draft(gen)
        tokens = verifier.verify(draft, target_logits_for(draft), params, gen).new_tokens
        if len(tokens) == 1:  # the next step would sample x2 from the target
            tokens.append(sample(P1[tokens[0]], gen))
        counts[tokens[0], tokens[1]] += 1
    return counts


@pytest.mark.parametrize("make_draft", [sampled_chain, sampled_tree, deterministic_tree])
def test_rejection_verifier_reproduces_the_target_distribution(make_draft):
    n = 20000
    assert tv(joint_counts(make_draft, RejectionVerifier(), n), EXACT) < tv_bound(V * V, n)


@pytest.mark.parametrize("make_draft", [sampled_chain, sampled_tree, deterministic_tree])
def test_a_wrong_residual_fails_the_bound(make_draft):
    n = 20000
    assert tv(joint_counts(make_draft, WrongResidualVerifier(), n), EXACT) > tv_bound(V * V, n)


@pytest.mark.parametrize("make_draft", [sampled_chain, sampled_tree])
def test_accepting_with_p_fails_the_bound(make_draft, monkeypatch):
    """A planted bug in the acceptance rule (p(x) instead of min(1, p(x) / q(x))) at the verifier level. (For a
    deterministic draft q(x) = 1 and the two rules agree.)"""
    monkeypatch.setattr(rejection, "likelihood_ratio", accepts_with_p)
    n = 20000
    assert tv(joint_counts(make_draft, RejectionVerifier(), n), EXACT) > tv_bound(V * V, n)


def test_top_k_and_top_p_warping():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0]).log()  # probs 0.4, 0.3, 0.2, 0.1, 0
    assert probs_from_logits(logits, SamplingParams(1.0, top_k=2)).tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0, 0])
    assert probs_from_logits(logits, SamplingParams(1.0, top_p=0.65)).tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0, 0])
    assert probs_from_logits(logits, SamplingParams(1.0, top_p=0.7)).tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0, 0])
    assert probs_from_logits(logits, SamplingParams(1.0, top_p=0.71)).tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0, 0])
    hot = probs_from_logits(torch.tensor([1.0, 0.0]), SamplingParams(temperature=2.0))
    assert hot.tolist() == pytest.approx(torch.softmax(torch.tensor([0.5, 0.0]), -1).tolist())


# ---- end to end through the engine ------------------------------------------------------------------------
# The joint distribution of the first four new tokens: the prefill samples the first, and the first draft below it
# is cut to depth 3, so tokens 2-4 are accepted at depths 1-3 (or come from later steps after a rejection). With a
# 4-token vocabulary the joint has 256 cells, computed exactly from 85 prefills; Pearson's chi-square test compares
# it with the engine's counts. Each case asserts that a depth-3 draft token was accepted in it.
#
# The test's size comes from power.py: a sampler whose 4-token joint differs from the exact one by a chi-square
# divergence of MIN_SHIFT fails it with probability POWER. Two targets, each setting sampling one: on the flat one a
# wrong acceptance rule or draft distribution shifts the joint by more than that, on the sharp one (drafts accepted
# deep) an error at depth 3 or in a tree's later branch does; each planted bug below fails at the matrix's own
# sample count, on the target of its setting. Every chi-square case of a correct build fails with probability ALPHA,
# so the whole module fails a correct build with probability at most len(chi-square cases) * ALPHA
# (SUITE_FALSE_FAILURE, checked below). The seeds are fixed, so a given build passes or fails every time.

ENGINE_V = 4
JOINT = 4  # new tokens compared
ATTENTION = 0.3  # the tiny targets' attention scale: weak, so their greedy text repeats and lookups find it
TARGETS = {  # name: initializer range (the sharpness of its next-token rows)
    "sharp": 1.0,  # most likely token ~0.9: drafts accepted deep, so errors at depth 3 and in later branches show
    "flat": 0.2,  # most likely token ~0.6: drafts often rejected, so errors of the acceptance rule and of q show
}
SETTINGS = {  # name: (sampling parameters, the target it samples)
    "t1": (SamplingParams(temperature=1.0), "flat"),
    "t0.7": (SamplingParams(temperature=0.7), "sharp"),
    "topk2": (SamplingParams(temperature=1.0, top_k=2), "flat"),
    "topp0.95": (SamplingParams(temperature=1.0, top_p=0.95), "sharp"),
}
TOKEN_WISE = {  # sampled chains verified token by token (the matrix verifies them with the default block rule)
    "token-t1": (SamplingParams(temperature=1.0, verification="token"), "flat"),
    "token-t0.7": (SamplingParams(temperature=0.7, verification="token"), "sharp"),
}
T1 = SETTINGS["t1"][0]
ALPHA = 1e-5  # a correct sampler fails one chi-square test with this probability
MIN_SHIFT, POWER = 0.12, 0.9  # the smallest chi-square divergence of the joint each case must catch, how surely
CHAIN, TREE = {"depth": 3, "topk": 1}, {"depth": 3, "topk": 3, "budget": 7}  # draft-model drafts: a sampled chain,
# three sampled chains (first tokens without replacement)


def matrix(drafters: dict) -> list[tuple[str, dict, str]]:
    """Every drafter at every sampling setting, and every variant of it at one setting at least (variants taken in
    turn: case i runs variant i mod len(variants) at setting i mod len(SETTINGS))."""
    cases = []
    for name, cls in sorted(drafters.items()):
        for i in range(max(len(cls.variants), len(SETTINGS))):
            cases.append((name, cls.variants[i % len(cls.variants)], list(SETTINGS)[i % len(SETTINGS)]))
    return cases


MATRIX = matrix({name: cls for name, cls in DRAFTERS.items() if cls.supports_sampling and not cls.foreign_vocabulary})


def case_id(name: str, variant: dict, setting: str) -> str:
    return f"{name}{variant or ''}-{setting}"


def engine_samples(min_shift: float = MIN_SHIFT) -> int:
    """Samples per case: enough that a shift of min_shift fails with probability POWER (at the joint's full
    degrees of freedom; pooling rare cells only lowers them, and raises the power)."""
    return samples_for(min_shift, ENGINE_V**JOINT - 1, ALPHA, POWER)


ENGINE_SAMPLES = engine_samples()


@pytest.fixture(scope="module")
def engine_setups() -> dict:
    return {name: build_engine_setup(sharpness) for name, sharpness in TARGETS.items()}


def build_engine_setup(sharpness: float):
    """(target, draft model, prompt, the target's logits after every prompt + prefix of fewer than JOINT tokens);
    the prompt is the target's own greedy continuation, so lookups find what it is likely to say."""
    # the native backend: the same function with less per-forward overhead than transformers
    hf = tiny_model("llama", seed=5, vocab=ENGINE_V, layers=1, hidden=16, initializer_range=sharpness)
    with torch.no_grad():
        hf.model.model.layers[0].self_attn.o_proj.weight.mul_(ATTENTION)
    target = native_twin(hf)
    draft_model = perturbed_copy(target, scale=0.1, seed=6)
    start = [1, 2, 3]
    prompt = start + generate(target, build_drafter("none", target), start, 16, SamplingParams())[0]
    return target, draft_model, prompt, prefix_logits(target, prompt, JOINT)


def prefix_logits(target, prompt: list[int], length: int) -> dict[tuple[int, ...], torch.Tensor]:
    """The target's [V] next-token logits after prompt + every prefix of fewer than `length` new tokens."""
    from specdecode.audit import next_token_logits

    vocab = target.vocab_size
    return {
        prefix: next_token_logits(target, prompt + list(prefix))
        for depth in range(length) for prefix in itertools.product(range(vocab), repeat=depth)
    }


def exact_joint(logits: dict[tuple[int, ...], torch.Tensor], params: SamplingParams, vocab: int, length: int):
    """[V] * length: the probability of each sequence of `length` new tokens under plain sampling."""
    joint = torch.ones((), dtype=torch.float64)
    for depth in range(length):
        prefixes = itertools.product(range(vocab), repeat=depth)
        rows = torch.stack([probs_from_logits(logits[prefix], params).double() for prefix in prefixes])
        joint = joint[..., None] * rows.reshape(*([vocab] * depth), vocab)
    return joint


def chi_square(counts: torch.Tensor, exact: torch.Tensor, min_expected: float = 5.0) -> tuple[float, float, int]:
    """Pearson's goodness of fit of counts to exact (same shape): (p-value, statistic, degrees of freedom). Cells
    expected fewer than min_expected times are pooled into one. A count in a cell of probability 0 (a token top-k
    or top-p removed) gives p = 0."""
    observed = counts.double().flatten()
    expected = exact.double().flatten() * observed.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0, math.inf, 0
    kept = expected >= min_expected
    observed = torch.cat([observed[kept], observed[~kept].sum()[None]])
    expected = torch.cat([expected[kept], expected[~kept].sum()[None]])
    if expected[-1] == 0:  # nothing pooled
        observed, expected = observed[:-1], expected[:-1]
    if len(expected) < 2:  # one possible outcome: nothing more to compare
        return 1.0, 0.0, 0
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return chi_square_survival(statistic, len(expected) - 1), statistic, len(expected) - 1


def chi_square_p_value(counts: torch.Tensor, exact: torch.Tensor) -> float:
    return chi_square(counts, exact)[0]


@dataclasses.dataclass
class CaseResult:
    p_value: float
    shift: float  # the chi-square divergence the counts show: (statistic - dof) / n, ~0 for a correct sampler
    accepted: int  # the deepest draft token accepted in any step
    drafted: int  # the deepest draft token proposed, capped at the depth the comparison reaches


def engine_counts(target, drafter, prompt, params: SamplingParams, vocab: int, length: int, n: int, at: int = 0):
    """(counts [V] * length of the new tokens at..at+length over n seeded generations, deepest accepted draft
    token, deepest proposed draft token)."""
    counts = torch.zeros([vocab] * length)
    proposed = []
    propose = drafter.propose

    def recorded(*args):
        draft = propose(*args)
        proposed.append(int(depths(draft.parents).max()) if len(draft) else 0)
        return draft

    drafter.propose = recorded
    deepest = 0
    for seed in range(n):
        seeded = dataclasses.replace(params, seed=seed)
        tokens, stats = generate(target, drafter, prompt, at + length + 1, seeded)
        counts[tuple(tokens[at : at + length])] += 1
        deepest = max([deepest, *stats.accepted_per_step])
    del drafter.propose
    return counts, deepest, max(proposed, default=0)


def engine_case(setups: dict, name: str, variant: dict, setting: str, n: int = ENGINE_SAMPLES) -> CaseResult:
    """One drafter (built from name and variant) at one setting, on the target the setting samples."""
    params, target_name = {**SETTINGS, **TOKEN_WISE}[setting]
    target, draft_model, prompt, logits = setups[target_name]
    options = dict(variant, **({"draft_model": draft_model} if DRAFTERS[name].needs_draft_model else {}))
    drafter = build_drafter(name, target, **options)
    counts, accepted, drafted = engine_counts(target, drafter, prompt, params, target.vocab_size, JOINT, n)
    p_value, statistic, dof = chi_square(counts, exact_joint(logits, params, target.vocab_size, JOINT))
    return CaseResult(p_value, (statistic - dof) / n, accepted, min(drafted, JOINT - 1))


def shallow(name: str, variant: dict, setting: str) -> str:
    return case_id(name, DRAFTERS[name].variants[variant] if isinstance(variant, int) else variant, setting)


SHALLOW = {  # case: the depth its accepted drafts reach at least, where that is under 3 (else 3, asserted per case)
    # options that draft fewer than three tokens
    shallow("draft", {"depth": 1, "topk": 1}, "topp0.95"): 1,
    shallow("hierarchy", 1, "t0.7"): 2, shallow("hierarchy", 1, "topp0.95"): 2,  # length 2
    shallow("hydra", 1, "t0.7"): 2,  # depth 2
    shallow("jacobi", 1, "t0.7"): 2, shallow("jacobi", 1, "topp0.95"): 2,  # window 2
    shallow("pld", 2, "topk2"): 2,  # k 2
    shallow("esp", 1, "t0.7"): 2,  # 2 probes
    # ESP drafts from the probes of the step before: its first draft is probes only (none accepted), and the
    # second, a step later, reaches positions past the four compared; the probe "nearest" variant is accepted at
    # depth 3 (its probes are tokens)
    shallow("esp", 0, "t1"): 0, shallow("esp", 0, "topp0.95"): 0,
    # drafts whose depth-3 tokens are never all accepted in this window (measured over ENGINE_SAMPLES seeds)
    shallow("jacobi", 0, "topk2"): 2, shallow("lookahead", 2, "topk2"): 1, shallow("lookahead", 0, "topp0.95"): 2,
    shallow("suffix", 0, "t1"): 2,
    # foreign vocabularies: under top-k=2 the draft's top tokens rarely spell the target's two; with the
    # confidence length (threshold 0.3) slem's drafts stop before depth 3 where the sharper settings' target
    # leaves its draft unsure
    shallow("slem", 0, "topk2"): 1, shallow("slrs", 0, "topk2"): 1, shallow("tli", 0, "topk2"): 1,
    shallow("slem", 1, "t0.7"): 2, shallow("slem", 1, "topp0.95"): 2,
}


@pytest.mark.parametrize("name,variant,setting", MATRIX, ids=[case_id(*case) for case in MATRIX])
def test_engine_sampling_matches_plain_sampling_to_depth_3(engine_setups, name, variant, setting):
    result = engine_case(engine_setups, name, variant, setting)
    assert result.p_value > ALPHA, result
    if name != "none":
        assert result.accepted >= SHALLOW.get(case_id(name, variant, setting), JOINT - 1), result


class DeepBias(RejectionVerifier):
    """A planted bug at depth 3 only: the target's logits that score depth-3 tokens are a little too flat."""

    def verify(self, draft, target_logits, params, generator):
        scores_depth_3 = torch.cat([torch.tensor([False]), depths(draft.parents) == 2])  # [N+1]: depth-2 rows
        flattened = target_logits.clone()  # [N+1, V]
        flattened[scores_depth_3] *= 0.75
        return super().verify(draft, flattened, params, generator)


def leaky_residual(target_probs, draft_probs):
    """A planted bug: the residual keeps some of the target's own distribution (the rejected tokens' mass)."""
    return 0.5 * (residual(target_probs, draft_probs) + target_probs)


def sequence_mask(parents: torch.Tensor) -> torch.Tensor:
    """A planted bug, a mask leak: the tree verified as one sequence, so every node also sees the nodes drafted before
    it on other branches (its earlier siblings' subtrees)."""
    n = parents.shape[0]
    return torch.ones(n, n, dtype=torch.bool).tril()  # [N+1, N+1]


def stop_without_shortfall(target_probs, draft_probs, weights):
    """A planted bug: block verification's stop probabilities leave out the weight's shortfall 1 - w_i."""
    masses = [float(block.residual_mass(w, target_probs[i], draft_probs[i]).sum()) for i, w in enumerate(weights[:-1])]
    return [min(1.0, m) for m in masses[1:]] + [weights[-1]]


def accepts_with_p(target_prob: float, draft_prob: float) -> float:
    """A planted bug: a drafted token accepted with probability p(x) instead of min(1, p(x) / q(x))."""
    return target_prob


def draws_colder(propose):
    """A planted bug: the draft model samples at 0.7 times the temperature but reports the distribution at the
    temperature asked for (q at T is q at 0.7 T raised to the power 0.7, renormalised)."""

    def colder(self, context, params, generator):
        draft = propose(self, context, dataclasses.replace(params, temperature=0.7 * params.temperature), generator)
        if draft.draft_probs is None:
            return draft
        reported = draft.draft_probs**0.7  # [N, V]
        return dataclasses.replace(draft, draft_probs=reported / reported.sum(-1, keepdim=True))

    return colder


PLANTED = {
    "bias at depth 3": ("specdecode.engine.verifier_for", lambda params: DeepBias()),
    "leaky residual": ("specdecode.verify.rejection.residual", leaky_residual),
    "block stop without shortfall": ("specdecode.verify.block.stop_probabilities", stop_without_shortfall),
    "mask leak": ("specdecode.models.base.ancestor_mask", sequence_mask),
    "accept with p": ("specdecode.verify.rejection.likelihood_ratio", accepts_with_p),
    "draws colder": (DraftModelDrafter, "propose", draws_colder(DraftModelDrafter.propose)),
}
PLANTED_CASES = [  # each where its bug shows: the setting's target decides
    ("bias at depth 3", "pld", {}, "t0.7"),
    ("bias at depth 3", "draft", TREE, "t1"),
    ("leaky residual", "recycling", {}, "t1"),
    ("leaky residual", "draft", TREE, "t0.7"),
    ("block stop without shortfall", "draft", CHAIN, "t0.7"),
    ("mask leak", "suffix", {}, "t0.7"),  # its trees' later branches are accepted often
    ("accept with p", "draft", CHAIN, "t1"),
    ("accept with p", "draft", CHAIN, "token-t1"),
    ("accept with p", "draft", TREE, "t1"),
    ("draws colder", "draft", CHAIN, "t1"),
    ("draws colder", "draft", TREE, "topk2"),
]


@pytest.mark.parametrize("bug,name,variant,setting", PLANTED_CASES,
                         ids=[f"{case[0]}-{case_id(*case[1:])}" for case in PLANTED_CASES])
def test_planted_engine_bugs_fail_the_test(engine_setups, monkeypatch, bug, name, variant, setting):
    monkeypatch.setattr(*PLANTED[bug])
    result = engine_case(engine_setups, name, variant, setting)
    assert result.p_value < ALPHA, result


@pytest.mark.parametrize("setting", TOKEN_WISE)
def test_token_wise_verification_of_sampled_chains_matches_plain_sampling(engine_setups, setting):
    """The matrix verifies sampled chains with the default (block) rule; the token rule stays covered here."""
    result = engine_case(engine_setups, "draft", CHAIN, setting)
    assert result.p_value > ALPHA and result.accepted == JOINT - 1, result


# ---- drafters with another tokenizer: the first two tokens, through the engine ----------------------------------

FOREIGN_V = 8


def foreign_target(tokenizer=None, initializer_range: float = 0.6):
    model = tiny_model("llama", seed=5, vocab=FOREIGN_V, layers=1, hidden=16, initializer_range=initializer_range)
    if tokenizer is not None:
        model.tokenizer = tokenizer
    return native_twin(model)


# Eight-token byte-level BPE vocabularies over "abc" for drafters that take another tokenizer. The draft's "bc"
# and "bca" are not target tokens but begin one ("bcab"): SLRS spells it as "bc" + "ab" or "bca" + "b"; its "aa"
# and "cc" lead nowhere, so TLI's restriction drops real mass.
ENGINE_TARGET_VOCAB = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "ca": 5, "cab": 6, "bcab": 7}
ENGINE_TARGET_MERGES = [("a", "b"), ("ab", "c"), ("c", "a"), ("ca", "b"), ("b", "cab")]
ENGINE_DRAFT_VOCAB = {"c": 0, "b": 1, "a": 2, "bc": 3, "bca": 4, "ab": 5, "aa": 6, "cc": 7}
ENGINE_DRAFT_MERGES = [("b", "c"), ("bc", "a"), ("a", "b"), ("a", "a"), ("c", "c")]
# [input token, next token] logit offsets for the draft: after most tokens it leans to "bc" and "bca" and to the
# dead ends "aa" and "cc"; after "bc" to "ab" and "a", after "bca" to "b", so "bcab" gets spelled often.
ENGINE_DRAFT_BIAS = torch.tensor([[0.0, 0, 0, 4, 4, 0, 3, 2]] * 3 + [[0.0, 0, 3, -4, -4, 5, 0, 0]]
                                 + [[0.0, 6, 0, -4, -4, 0, 0, 0]] + [[0.0, 0, 0, 4, 4, 0, 3, 2]] * 3)


class LogitBias:
    """A draft model whose logits are another model's plus an offset [V, V] that depends on the input token."""

    def __init__(self, model, bias: torch.Tensor, tokenizer):
        self.model, self.bias, self.tokenizer = model, bias, tokenizer

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, cache, input_ids, *args, **kwargs):
        logits = self.model.forward(cache, input_ids, *args, **kwargs)  # [q or 1, V]
        return logits + self.bias[input_ids[-logits.shape[0] :]]


@pytest.fixture(scope="module")
def foreign_engine_setup():
    # a flatter target than engine_setup's, so a wrong draft probability shows in the second token
    target = foreign_target(bpe_tokenizer(vocab=ENGINE_TARGET_VOCAB, merges=ENGINE_TARGET_MERGES), 0.15)
    draft = tiny_model("llama", seed=7, vocab=FOREIGN_V, layers=1, hidden=16, initializer_range=0.6)
    draft_model = LogitBias(native_twin(draft), ENGINE_DRAFT_BIAS,
                            bpe_tokenizer(vocab=ENGINE_DRAFT_VOCAB, merges=ENGINE_DRAFT_MERGES))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    return target, draft_model, prompt, prefix_logits(target, prompt, JOINT)


FOREIGN_MATRIX = matrix({name: cls for name, cls in DRAFTERS.items()
                         if cls.supports_sampling and cls.foreign_vocabulary})
FOREIGN_N = 1000
# The first four new tokens' joint over 8 tokens has 4,096 cells: too many for 1,000 samples, so each case tests two
# of its marginals, the first pair of tokens (the draft's depth 1 against the prefill's token) and the last pair
# (depths 2 and 3), each at level ALPHA.
PAIRS = ((0, 1), (2, 3))


def foreign_case(setup, name, variant, params, drafter=None) -> tuple[list[float], int]:
    """(p-value of each pair in PAIRS, deepest accepted draft token) of a foreign-vocabulary drafter."""
    target, draft_model, prompt, logits = setup
    if drafter is None:
        drafter = build_drafter(name, target, draft_model=draft_model, **variant)
    counts, accepted, _ = engine_counts(target, drafter, prompt, params, FOREIGN_V, JOINT, FOREIGN_N)
    exact = exact_joint(logits, params, FOREIGN_V, JOINT)
    p_values = []
    for pair in PAIRS:
        others = tuple(axis for axis in range(JOINT) if axis not in pair)
        p_values.append(chi_square_p_value(counts.sum(others), exact.sum(others)))
    return p_values, accepted


@pytest.mark.parametrize("name,variant,setting", FOREIGN_MATRIX, ids=[case_id(*case) for case in FOREIGN_MATRIX])
def test_foreign_vocabulary_sampling_matches_plain_sampling(foreign_engine_setup, name, variant, setting):
    p_values, accepted = foreign_case(foreign_engine_setup, name, variant, SETTINGS[setting][0])
    assert min(p_values) > ALPHA, p_values
    assert accepted >= SHALLOW.get(case_id(name, variant, setting), JOINT - 1), accepted


class SendsOtherRows:
    """For planted bugs: draws its chain as the drafter does, but sends the rows its levels put in self.sent."""

    def propose(self, context, params, generator):
        self.sent = []
        draft = super().propose(context, params, generator)
        return Draft.chain(draft.tokens, torch.stack(self.sent[: len(draft)]) if len(draft) else None)


class ForgetsRenormalising(SendsOtherRows, TLIDrafter):
    """A planted bug: draws from the renormalised restriction but sends the restricted mass as it was."""

    def propose_level(self, logits, node, params):
        proposal = super().propose_level(logits, node, params)
        self.sent.append(proposal.mass)
        return proposal


class ForgetsLongerSpellings(SendsOtherRows, SLRSDrafter):
    """A planted bug: draws from psi over every spelling but sends TLI's psi (one-token spellings only)."""

    def propose_level(self, logits, node, params):
        single = TLIDrafter.propose_level(self, logits, node, params).mass
        self.sent.append(single / single.sum())
        return super().propose_level(logits, node, params)


@pytest.mark.parametrize("planted", [ForgetsRenormalising, ForgetsLongerSpellings])
def test_a_wrong_heterogeneous_proposal_fails_the_test(foreign_engine_setup, planted):
    target, draft_model, _, _ = foreign_engine_setup
    drafter = planted(target, draft_model, depth=3)
    p_values, _ = foreign_case(foreign_engine_setup, planted.__name__, {}, T1, drafter)
    assert min(p_values) < ALPHA, p_values


# ---- the whole module -------------------------------------------------------------------------------------------
# A correct build fails each chi-square case with probability ALPHA and each total-variation case with probability
# 1e-4 (tv_bound's delta), so the module fails it with probability at most their sum (the union bound).
CHI_SQUARE_CASES = len(MATRIX) + len(TOKEN_WISE) + len(FOREIGN_MATRIX) * len(PAIRS) + 1  # + test_datastore's
TV_CASES = 3
SUITE_FALSE_FAILURE = CHI_SQUARE_CASES * ALPHA + TV_CASES * 1e-4


def test_a_correct_build_fails_this_module_rarely():
    """The union bound above, with every chi-square case sized by power.py to catch a shift of MIN_SHIFT."""
    assert SUITE_FALSE_FAILURE < 0.002, SUITE_FALSE_FAILURE
    assert power(MIN_SHIFT, ENGINE_SAMPLES, ENGINE_V**JOINT - 1, ALPHA) >= POWER
