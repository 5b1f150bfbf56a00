"""Speculative sampling must reproduce the target's sampling distribution exactly.

Verifier level: a synthetic target p(x1), p(x2 | x1) over a 5-token vocabulary; three draft kinds (a chain sampled
from q, a tree sampled without replacement, a deterministic tree); the empirical joint distribution of the first
two tokens over 20,000 draws must lie within a total-variation bound that holds with probability 1 - 1e-4
(Bretagnolle-Huber-Carol: P(TV > eps) <= 2^K exp(-2 n eps^2)). A verifier with a wrong residual must fail it.
Engine level: the same check end to end on a tiny model, for every drafter that supports sampling.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from specdecode.drafters import DRAFTERS, build_drafter
from specdecode.drafters.slrs import SLRSDrafter
from specdecode.drafters.tli import TLIDrafter
from specdecode.engine import generate
from specdecode.sampling import SamplingParams, probs_from_logits, sample
from specdecode.tree import Draft, depths
from specdecode.verify import RejectionVerifier, block
from specdecode.verify.rejection import residual
from specdecode.verify.base import verdict

from conftest import bpe_tokenizer, native_twin, perturbed_copy, tiny_model
from power import chi_square_survival

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
# 4-token vocabulary the joint has 256 cells, computed exactly from 85 prefills; a chi-square test compares it with
# the engine's counts. The target is sharp and its prompt is its own greedy continuation, so lookups find what it
# is likely to say and drafts are accepted to depth 3 (its attention is weak, so its own greedy text repeats). Each
# planted bug below must fail the same test at the same sample count.

ENGINE_V = 4
JOINT = 4  # new tokens compared
ENGINE_SAMPLES = 1000
SHARPNESS, ATTENTION = 1.0, 0.3
ALPHA = 1e-4  # a correct engine fails a case with this probability
SETTINGS = [  # each case runs one, in turn, so every drafter meets several
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=2),
    SamplingParams(temperature=1.0, top_p=0.95),
]
SAMPLING_CASES = [  # foreign-vocabulary drafters have their own setup below (two tokenizers that differ)
    (name, variant) for name, cls in sorted(DRAFTERS.items())
    if cls.supports_sampling and not cls.foreign_vocabulary for variant in cls.variants
]


@pytest.fixture(scope="module")
def engine_setup():
    # the native backend: the same function with less per-forward overhead than transformers
    hf = tiny_model("llama", seed=5, vocab=ENGINE_V, layers=1, hidden=16, initializer_range=SHARPNESS)
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


def chi_square_p_value(counts: torch.Tensor, exact: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's goodness of fit of counts to exact (same shape); cells expected fewer than min_expected times are
    pooled into one. A count in a cell of probability 0 (a token top-k or top-p removed) gives 0."""
    observed = counts.double().flatten()
    expected = exact.double().flatten() * observed.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0
    kept = expected >= min_expected
    observed = torch.cat([observed[kept], observed[~kept].sum()[None]])
    expected = torch.cat([expected[kept], expected[~kept].sum()[None]])
    if expected[-1] == 0:  # nothing pooled
        observed, expected = observed[:-1], expected[:-1]
    if len(expected) < 2:  # one possible outcome: nothing more to compare
        return 1.0
    statistic = ((observed - expected) ** 2 / expected).sum()
    return chi_square_survival(float(statistic), len(expected) - 1)


def engine_counts(target, drafter, prompt, params: SamplingParams, vocab: int, length: int, n: int, at: int = 0):
    """(counts [V] * length of new tokens at..at+length over n seeded generations, deepest accepted draft,
    deepest proposed draft (both capped by the generation's length))."""
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


def engine_case(engine_setup, name, variant, params, n=ENGINE_SAMPLES):
    """(chi-square p-value, deepest accepted, deepest drafted) of one drafter on the engine setup."""
    target, draft_model, prompt, logits = engine_setup
    options = dict(variant, **({"draft_model": draft_model} if DRAFTERS[name].needs_draft_model else {}))
    drafter = build_drafter(name, target, **options)
    counts, accepted, drafted = engine_counts(target, drafter, prompt, params, ENGINE_V, JOINT, n)
    return chi_square_p_value(counts, exact_joint(logits, params, ENGINE_V, JOINT)), accepted, min(drafted, JOINT - 1)


@pytest.mark.parametrize(
    "name,variant,params",
    [(n, v, SETTINGS[i % len(SETTINGS)]) for i, (n, v) in enumerate(SAMPLING_CASES)],
    ids=[f"{n}{v or ''}" for n, v in SAMPLING_CASES],
)
def test_engine_sampling_matches_plain_sampling_to_depth_3(engine_setup, name, variant, params):
    p_value, accepted, _ = engine_case(engine_setup, name, variant, params)
    assert p_value > ALPHA, p_value
    DEEPEST[name] = max(DEEPEST.get(name, 0), accepted)


DEEPEST: dict[str, int] = {}  # drafter: the deepest draft token the matrix above saw accepted


def test_the_matrix_accepted_drafts_at_depth_3():
    """What the matrix proves reaches depth 3: for every drafter, some variant had a depth-3 token accepted."""
    names = {name for name, _ in SAMPLING_CASES} - {"none"}
    if not names <= set(DEEPEST):
        pytest.skip("runs after the whole sampling matrix")
    assert {name: DEEPEST[name] for name in names} == dict.fromkeys(names, JOINT - 1)


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


PLANTED = {
    "bias at depth 3": ("specdecode.engine.verifier_for", lambda params: DeepBias()),
    "leaky residual": ("specdecode.verify.rejection.residual", leaky_residual),
    "block stop without shortfall": ("specdecode.verify.block.stop_probabilities", stop_without_shortfall),
    "mask leak": ("specdecode.models.base.ancestor_mask", sequence_mask),
}


TOKEN_WISE = SamplingParams(temperature=1.0, verification="token")  # sampled chains verified token by token


@pytest.mark.parametrize(
    "bug,name,variant,params",
    [
        ("bias at depth 3", "pld", {}, SETTINGS[0]),
        ("bias at depth 3", "draft", {"depth": 3, "topk": 3, "budget": 7}, SETTINGS[0]),
        ("leaky residual", "recycling", {}, SETTINGS[0]),
        ("leaky residual", "draft", {"depth": 3, "topk": 1}, TOKEN_WISE),
        ("block stop without shortfall", "draft", {"depth": 3, "topk": 1}, SETTINGS[0]),
        ("mask leak", "suffix", {}, SETTINGS[0]),  # its trees' later branches are accepted often
    ],
)
def test_planted_engine_bugs_fail_the_test(engine_setup, monkeypatch, bug, name, variant, params):
    monkeypatch.setattr(*PLANTED[bug])
    p_value, _, _ = engine_case(engine_setup, name, variant, params)
    assert p_value < ALPHA, p_value


def test_token_wise_verification_of_sampled_chains_matches_plain_sampling(engine_setup):
    """The matrix verifies sampled chains with the default (block) rule; the token rule stays covered here."""
    p_value, accepted, _ = engine_case(engine_setup, "draft", {"depth": 3, "topk": 1}, TOKEN_WISE)
    assert p_value > ALPHA and accepted == JOINT - 1, (p_value, accepted)


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
    return (target, draft_model) + foreign_exact_first_pair(target)


def foreign_exact_first_pair(target) -> tuple[list[int], torch.Tensor]:
    """A prompt and the exact [V, V] joint distribution of the first two tokens after it, at temperature 1."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    from specdecode.models.base import prefill

    cache = target.new_cache(32)
    params = SamplingParams(temperature=1.0)
    p1 = probs_from_logits(prefill(target, cache, prompt), params)  # [V]
    rows = []
    for x1 in range(FOREIGN_V):
        cache = target.new_cache(32)
        rows.append(probs_from_logits(prefill(target, cache, prompt + [x1]), params))
    return prompt, p1[:, None] * torch.stack(rows)  # exact joint [V, V]


FOREIGN_CASES = [
    (name, variant) for name, cls in sorted(DRAFTERS.items())
    if cls.supports_sampling and cls.foreign_vocabulary for variant in cls.variants
]


@pytest.mark.parametrize("name,variant", FOREIGN_CASES, ids=[f"{n}{v or ''}" for n, v in FOREIGN_CASES])
def test_foreign_vocabulary_sampling_matches_plain_sampling(foreign_engine_setup, name, variant):
    target, draft_model, prompt, exact = foreign_engine_setup
    options = dict(variant, **({"draft_model": draft_model} if DRAFTERS[name].needs_draft_model else {}))
    assert foreign_p_value(target, build_drafter(name, target, **options), prompt, exact) > ALPHA


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
def test_a_wrong_heterogeneous_proposal_fails_the_bound(foreign_engine_setup, planted):
    target, draft_model, prompt, exact = foreign_engine_setup
    assert foreign_p_value(target, planted(target, draft_model, depth=2), prompt, exact) < ALPHA


FOREIGN_N = 1000  # the planted bugs above land near p = 1e-70 at 500 samples; the engine test's chi-square


def foreign_p_value(target, drafter, prompt, exact) -> float:
    """Chi-square p-value of the first two sampled tokens over FOREIGN_N seeded generations against `exact`."""
    return chi_square_p_value(foreign_pair_counts(target, drafter, prompt, 3, (0, 1), FOREIGN_V, FOREIGN_N), exact)


def foreign_pair_counts(target, drafter, prompt, max_new_tokens: int, at: tuple[int, int], vocab: int, n: int):
    """[V, V] counts of the new tokens at positions `at` over n seeded engine generations at temperature 1."""
    counts = torch.zeros(vocab, vocab)
    for seed in range(n):
        tokens, _ = generate(target, drafter, prompt, max_new_tokens, SamplingParams(temperature=1.0, seed=seed))
        counts[tokens[at[0]], tokens[at[1]]] += 1
    return counts
