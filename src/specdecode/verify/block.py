"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh; ICLR 2025) of a sampled chain.

Token-by-token verification decides each drafted token on its own: the first rejection ends the block. Block
verification decides the block jointly. It carries a weight w_i = min(1, w_{i-1} p(x_i) / q(x_i)) (w_0 = 1)
along the chain, so a token the draft under-proposed can make up for an earlier one it over-proposed, and stops
at position i (accepting x_1..x_i) with probability

    h_i = m_i / (m_i + 1 - w_i),   m_i = sum_x max(w_i p_{i+1}(x) - q_{i+1}(x), 0)   (i < n),   h_n = w_n,

keeping the largest i whose uniform draw falls under h_i. The token after the stop is sampled from the target at
the end of the block (i = n), else from norm(max(w_i p_{i+1} - q_{i+1}, 0)). The output is distributed exactly as
the target's, and the expected number of accepted tokens is the largest any valid verification of one draft can
reach, so never below token-by-token verification's.

It needs q in full at every position (draft_probs): a chain drafted deterministically (draft_probs None) has no
gain to take, since no rule can accept x_1..x_i more often than the target would generate them, which token-by-
token verification already does. Trees go to the token-wise recursive rule too: the paper's optimality argument
is for one draft, and a tree's siblings are tried against residuals that depend on the siblings before them, which
the block weight does not account for.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, probs_from_logits, sample
from ..tree import PROBE, Draft
from .base import Verdict, Verifier, verdict
from . import rejection
from .rejection import RejectionVerifier


def is_chain(draft: Draft) -> bool:
    return torch.equal(draft.parents, torch.arange(len(draft)) - 1)


def block_weights(target_probs: torch.Tensor, draft_probs: torch.Tensor, tokens: list[int]) -> list[float]:
    """[w_0 .. w_n]: w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)), where p_i, q_i = target_probs[i-1], draft_probs[i-1]
    (target_probs [n+1, V], draft_probs [n, V], float64)."""
    weights = [1.0]
    for i, token in enumerate(tokens):
        p, q = float(target_probs[i, token]), float(draft_probs[i, token])
        weights.append(min(1.0, weights[-1] * rejection.likelihood_ratio(p, q)) if q > 0 else float(p > 0))
    return weights


def residual_mass(weight: float, target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """[V] max(w p - q, 0), unnormalised: what the block still owes the target after stopping with weight w."""
    return (weight * target_row - draft_row).clamp_(min=0)


def correction(weight: float, target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """[V] the distribution of the token after a stop before the block's end: norm(max(w p - q, 0)), or p where
    nothing is owed (p == q up to rounding)."""
    owed = residual_mass(weight, target_row, draft_row)
    total = float(owed.sum())
    return owed / total if total > 0 else target_row


def stop_probabilities(target_probs: torch.Tensor, draft_probs: torch.Tensor, weights: list[float]) -> list[float]:
    """[h_1 .. h_n] from the block weights [w_0 .. w_n]: the probability of stopping at each position, before later
    positions are considered."""
    n = len(weights) - 1
    stops = []
    for i in range(1, n):
        mass = float(residual_mass(weights[i], target_probs[i], draft_probs[i]).sum())
        stops.append(mass / (mass + 1.0 - weights[i]) if mass > 0 else 0.0)  # no mass left: stopping here is impossible
    return stops + [weights[n]]


class BlockVerifier(Verifier):
    """Block verification for sampled chains; anything else (greedy, trees, deterministic drafts, probe nodes) goes
    to the token-wise rule, whose distribution is the same."""

    def __init__(self, fallback: Verifier | None = None):
        self.fallback = fallback or RejectionVerifier()

    def verify(self, draft: Draft, target_logits: torch.Tensor, params: SamplingParams, generator) -> Verdict:
        tokens = draft.tokens.tolist()
        if params.greedy or draft.draft_probs is None or not tokens or PROBE in tokens or not is_chain(draft):
            return self.fallback.verify(draft, target_logits, params, generator)
        n = len(tokens)
        target_probs = probs_from_logits(target_logits[: n + 1], params).double()  # [n+1, V]
        draft_probs = draft.draft_probs.double()  # [n, V]: row i the distribution token i was drawn from
        draws = torch.rand(n, generator=generator, dtype=torch.float64).tolist()
        weights = block_weights(target_probs, draft_probs, tokens)
        stops = stop_probabilities(target_probs, draft_probs, weights)
        stop = max((i + 1 for i in range(n) if draws[i] <= stops[i]), default=0)
        after = target_probs[n] if stop == n else correction(weights[stop], target_probs[stop], draft_probs[stop])
        return verdict(draft, list(range(stop)), sample(after.float(), generator))
