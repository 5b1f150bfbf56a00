"""Speculative sampling over a tree: recursive rejection sampling with residual updates.

One rule covers the three cases the literature treats separately:
- a chain sampled from the draft (Leviathan et al., Chen et al.): each node has one child;
- a tree whose siblings were sampled from the draft, with or without replacement (SpecInfer; EAGLE-1):
  draft_probs[c] is the distribution child c was drawn from, given its parent and the siblings drawn before it;
- a deterministic draft (n-gram lookup, top-k trees as in EAGLE-2): draft_probs is None, q is a point mass on the
  drafted token, so a child x is accepted with probability p(x) and a rejection zeroes p(x).

At a node with target distribution p, try its children in order: accept child x with probability
min(1, p(x) / q(x)); on rejection replace p by norm(max(p - q, 0)). If every child is rejected (or the node is a
leaf) the bonus token is sampled from the current p. Each step is a single-draft speculative step from q towards
the current p, so the emitted token is distributed exactly as p.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, probs_from_logits, sample
from ..tree import PROBE, Draft, children, with_root
from .base import Verdict, Verifier, verdict


def likelihood_ratio(target_prob: float, draft_prob: float) -> float:
    """p(x) / q(x) for a token x the draft drew from q (q(x) > 0): the token is accepted with probability
    min(1, p / q). The one place the acceptance rule lives, for the token-wise, block and Jacobi rules alike."""
    return target_prob / draft_prob


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); keeps p when the difference has no mass (p == q up to rounding)."""
    diff = (target_probs - draft_probs).clamp_(min=0)
    total = diff.sum()
    return diff / total if total > 0 else target_probs


class RejectionVerifier(Verifier):
    def verify(self, draft: Draft, target_logits: torch.Tensor, params: SamplingParams, generator) -> Verdict:
        kids = children(with_root(draft.parents))
        tokens = [None] + draft.tokens.tolist()
        node, accepted = 0, []
        target_probs = probs_from_logits(target_logits[0], params)  # [V]
        while True:
            for child in kids[node]:
                token = tokens[child]
                if token == PROBE:
                    continue
                q_row = None if draft.draft_probs is None else draft.draft_probs[child - 1]
                q_tok = 1.0 if q_row is None else float(q_row[token])
                p_tok = float(target_probs[token])
                if float(torch.rand((), generator=generator)) < likelihood_ratio(p_tok, q_tok):
                    accepted.append(child - 1)
                    node = child
                    target_probs = probs_from_logits(target_logits[child], params)
                    break
                if q_row is None:
                    q_row = torch.zeros_like(target_probs)
                    q_row[token] = 1.0
                target_probs = residual(target_probs, q_row)
            else:
                return verdict(draft, accepted, sample(target_probs, generator))
