"""Coupled Jacobi drafting: Speculative Jacobi Decoding with maximal coupling (MC-SJD, now "Speculative Coupled
Decoding"; So et al., arXiv 2510.24211), on top of SJD (Teng et al., ICLR 2025). No draft model.

The drafter keeps a window of guesses for the next `window` positions after the last committed token, each
with the distribution it was drawn from. The window is drafted as a chain; the target's one forward both
verifies it (chain rejection sampling with the window's distributions as draft_probs, so sampling stays
lossless) and yields, at every window position, a fresh target distribution p under the current guesses.

The Jacobi update re-draws each surviving position from its fresh p by a maximal coupling with the old guess
x ~ q: keep x with probability min(1, p(x) / q(x)), else draw from norm(max(p - q, 0)). The new guess is an
exact sample from p (its new draft distribution), yet equals the old one as often as possible, so guesses
stabilise across iterations instead of being resampled independently (plain SJD). Positions that enter the
window with no target distribution yet get a random context token with a point-mass draft distribution. At
temperature 0 p is one-hot and the update is plain Jacobi decoding: each guess becomes the target's argmax.
"""

from __future__ import annotations

import random

import torch

from ..errors import OptionError
from ..sampling import probs_from_logits
from ..tree import Draft
from ..verify import rejection
from ..verify.rejection import residual
from .base import Drafter, register


def coupled_draw(token: int, draft_row: torch.Tensor | None, target_probs: torch.Tensor, generator) -> int:
    """A sample from target_probs [V], maximally coupled with `token`, itself drawn from draft_row [V]
    (None: a point mass on `token`)."""
    q_tok = 1.0 if draft_row is None else float(draft_row[token])
    if float(torch.rand((), generator=generator)) < rejection.likelihood_ratio(float(target_probs[token]), q_tok):
        return token
    if draft_row is None:
        draft_row = torch.zeros_like(target_probs)
        draft_row[token] = 1.0
    return int(torch.multinomial(residual(target_probs, draft_row), 1, generator=generator))


@register("jacobi")
class JacobiDrafter(Drafter):
    sizes = {"window": "depth"}
    variants = ({}, {"window": 2})

    def __init__(self, target, window: int = 6):
        if window < 1:
            raise OptionError("need window >= 1")
        self.window, self.vocab_size = window, target.vocab_size
        self.max_nodes = window
        self.start([0], 0)

    def start(self, prompt_ids, capacity):
        self.rng = random.Random(0)
        # Position k of the window is the k+1-th token after the root. Per position: the guess (None: none
        # yet), the distribution it was drawn from (None: a point mass), the target logits seen there since
        # (None: none) which the next proposal couples it to.
        self.tokens: list[int | None] = []
        self.draft_rows: list[torch.Tensor | None] = []
        self.target_logits: list[torch.Tensor | None] = []
        self.draft: Draft | None = None

    def propose(self, context, params, generator) -> Draft:
        for k, logits in enumerate(self.target_logits):
            target_probs = probs_from_logits(logits, params)  # [V]
            token = self.tokens[k]
            if token is None:
                token = int(torch.multinomial(target_probs, 1, generator=generator))
            else:
                token = coupled_draw(token, self.draft_rows[k], target_probs, generator)
            self.tokens[k], self.draft_rows[k] = token, target_probs
        missing = self.window - len(self.tokens)
        self.tokens += [self.rng.choice(context) for _ in range(missing)]
        self.draft_rows += [None] * missing
        self.target_logits = []
        self.draft = Draft.chain(self.tokens, None if params.greedy else self.stacked_draft_rows())
        return self.draft

    def stacked_draft_rows(self) -> torch.Tensor:
        """[window, V]: each guess's draft distribution, point masses written out."""
        rows = torch.zeros(len(self.tokens), self.vocab_size)
        rows[torch.arange(len(self.tokens)), torch.tensor(self.tokens)] = 1.0
        for k, row in enumerate(self.draft_rows):
            if row is not None:
                rows[k] = row
        return rows

    def commit(self, verdict, draft, target_logits) -> None:
        n = len(draft)  # the engine may have cut the chain at the end of a request
        first = len(verdict.accepted) + 1  # old window index of the new window's first position
        # target_logits row r predicts old window index r: rows first..n cover the new window.
        self.tokens = (self.tokens[first:n] + [None])[: n + 1 - first]
        self.draft_rows = (self.draft_rows[first:n] + [None])[: n + 1 - first]
        self.target_logits = list(target_logits[first : n + 1])
