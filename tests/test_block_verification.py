"""Block verification keeps the target's distribution and accepts at least as much as token-by-token verification.

Exact: for a synthetic target and draft over a 4-token vocabulary and chains of 3 tokens, every draft (weighted by
its draft probability) and every stopping point (with the verifier's own stop probabilities and residuals) are
enumerated; the emitted tokens, continued by the target, must give the target's joint distribution of the next
4 tokens to 1e-9, and the expected number of accepted tokens must be at least token-by-token verification's (here
strictly more). Sampled: 20,000 draws through BlockVerifier.verify stay within the total-variation bound that
holds with probability 1 - 1e-4 (test_sampling_distribution.tv_bound). Each test has a planted bug it must catch.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specdecode.sampling import SamplingParams, sample
from specdecode.tree import Draft
from specdecode.verify import BlockVerifier, RejectionVerifier, verifier_for
from specdecode.verify import block

from test_sampling_distribution import stop_without_shortfall, tv, tv_bound

V, N = 4, 3  # vocabulary, chain length
T1 = SamplingParams(temperature=1.0)


def conditional(prefix: tuple[int, ...], salt: int, sharpness: float) -> torch.Tensor:
    """[V] float64: a fixed distribution for each prefix (target: salt 0, draft: salt 1)."""
    gen = torch.Generator().manual_seed(hash((prefix, salt)) % 2**31)
    return torch.softmax(torch.randn(V, generator=gen, dtype=torch.float64) * sharpness, -1)


def target(prefix):
    return conditional(prefix, 0, 1.5)


def draft(prefix):
    return conditional(prefix, 1, 1.5)


def chain_rows(tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(target_probs [N+1, V], draft_probs [N, V]) along a drafted chain."""
    target_rows = torch.stack([target(tokens[:i]) for i in range(N + 1)])
    draft_rows = torch.stack([draft(tokens[:i]) for i in range(N)])
    return target_rows, draft_rows


def target_joint(length: int) -> dict[tuple[int, ...], float]:
    return {seq: math.prod(float(target(seq[:i])[seq[i]]) for i in range(length))
            for seq in itertools.product(range(V), repeat=length)}


def block_outcomes():
    """(draft probability, stop, accepted tokens, [V] distribution of the token after them) for every draft and stop."""
    for tokens in itertools.product(range(V), repeat=N):
        target_rows, draft_rows = chain_rows(tokens)
        q_draft = math.prod(float(draft_rows[i, t]) for i, t in enumerate(tokens))
        weights = block.block_weights(target_rows, draft_rows, list(tokens))
        stops = block.stop_probabilities(target_rows, draft_rows, weights)
        for stop in range(N + 1):
            later = math.prod(1 - h for h in stops[stop:])  # no later position stopped
            p_stop = later if stop == 0 else stops[stop - 1] * later
            after = (target_rows[N] if stop == N
                     else block.correction(weights[stop], target_rows[stop], draft_rows[stop]))
            yield q_draft, p_stop, tokens[:stop], after


def emitted_joint(length: int) -> dict[tuple[int, ...], float]:
    """The joint of the first `length` tokens: block verification's step, then the target's own sampling."""
    joint = dict.fromkeys(itertools.product(range(V), repeat=length), 0.0)
    for q_draft, p_stop, accepted, after in block_outcomes():
        weight = q_draft * p_stop
        if weight == 0:
            continue
        for seq in joint:
            if seq[: len(accepted)] != accepted:
                continue
            rest = math.prod(float(target(seq[:i])[seq[i]]) for i in range(len(accepted) + 1, length))
            joint[seq] += weight * float(after[seq[len(accepted)]]) * rest
    return joint


def largest_gap() -> float:
    exact = target_joint(N + 1)
    return max(abs(p - exact[seq]) for seq, p in emitted_joint(N + 1).items())


def unweighted_residual(weight, target_row, draft_row):
    """A planted bug: the residual forgets the block weight (token-wise's residual after a block stop)."""
    return (target_row - draft_row).clamp(min=0)


def test_block_verification_reproduces_the_target_exactly():
    assert largest_gap() < 1e-9


@pytest.mark.parametrize("name,fn", [("residual_mass", unweighted_residual),
                                     ("stop_probabilities", stop_without_shortfall)])
def test_planted_block_bugs_break_the_exact_distribution(monkeypatch, name, fn):
    monkeypatch.setattr(block, name, fn)
    assert largest_gap() > 1e-3


def token_wise_expected_accepted() -> float:
    total = 0.0
    for tokens in itertools.product(range(V), repeat=N):
        target_rows, draft_rows = chain_rows(tokens)
        q_draft, survive = 1.0, 1.0
        expected = 0.0
        for i, t in enumerate(tokens):
            q_draft *= float(draft_rows[i, t])
            survive *= min(1.0, float(target_rows[i, t] / draft_rows[i, t]))
            expected += survive
        total += q_draft * expected
    return total


def test_block_verification_accepts_more_than_token_wise():
    block_expected = sum(q * p * len(accepted) for q, p, accepted, _ in block_outcomes())
    token_expected = token_wise_expected_accepted()
    assert block_expected > token_expected * 1.01, (block_expected, token_expected)


def sampled_joint(verifier, n: int) -> torch.Tensor:
    """[V]*(N+1) counts of the first N+1 tokens: one verification, then the target's own sampling."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros((V,) * (N + 1))
    for _ in range(n):
        tokens, draft_rows = [], []
        for i in range(N):
            q = draft(tuple(tokens))
            draft_rows.append(q)
            tokens.append(sample(q.float(), gen))
        target_rows, _ = chain_rows(tuple(tokens))
        chain = Draft.chain(tokens, torch.stack(draft_rows).float())
        out = verifier.verify(chain, target_rows.log().float(), T1, gen).new_tokens
        while len(out) < N + 1:
            out.append(sample(target(tuple(out)).float(), gen))
        counts[tuple(out[: N + 1])] += 1
    return counts


def exact_tensor() -> torch.Tensor:
    exact = torch.zeros((V,) * (N + 1), dtype=torch.float64)
    for seq, p in target_joint(N + 1).items():
        exact[seq] = p
    return exact


def test_block_verifier_samples_the_target_distribution():
    n = 20000
    assert tv(sampled_joint(BlockVerifier(), n), exact_tensor()) < tv_bound(V ** (N + 1), n)


def test_a_planted_block_bug_fails_the_sampled_bound(monkeypatch):
    monkeypatch.setattr(block, "stop_probabilities", stop_without_shortfall)
    n = 20000
    assert tv(sampled_joint(BlockVerifier(), n), exact_tensor()) > tv_bound(V ** (N + 1), n)


def test_block_is_the_default_for_sampling_and_token_wise_is_kept():
    assert isinstance(verifier_for(T1), BlockVerifier)
    assert type(verifier_for(SamplingParams(temperature=1.0, verification="token"))) is RejectionVerifier


def test_trees_and_deterministic_chains_go_to_the_token_rule():
    class Recording(RejectionVerifier):
        calls = 0

        def verify(self, *args):
            Recording.calls += 1
            return super().verify(*args)

    verifier = BlockVerifier(Recording())
    logits = torch.zeros(3, V)
    gen = torch.Generator().manual_seed(0)
    verifier.verify(Draft.chain([1, 2]), logits, T1, gen)  # deterministic: no draft_probs
    tree = Draft(torch.tensor([1, 2]), torch.tensor([-1, -1]), torch.full((2, V), 1 / V))
    verifier.verify(tree, logits, T1, gen)
    assert Recording.calls == 2
    verifier.verify(Draft.chain([1, 2], torch.full((2, V), 1 / V)), logits, T1, gen)
    assert Recording.calls == 2
