"""Self-speculation: drafters that draft with a part of the target itself (no second model), over the target's own
KV cache. Shared by `layerskip` (Draft & Verify: the target minus a skip set of sublayers) and the exit-head drafters
`kangaroo` and `eesd` (the target's first layers plus a small trained head).

A proposal is a chain below the root (context[-1], the last committed token, not yet in the target's cache): each
level runs the drafting network on the newest token at its position with CausalLM.forward_sublayers, attending to
the committed context and to the earlier draft tokens' entries, which stay uncommitted after the committed ones
(never touching them). After every drafted token the length policy (draft_length.py: `adaptive` for Draft & Verify,
`confidence` for Kangaroo's second early exit, `thompson` for EESD) decides from that token's draft probability
whether to draft another; `depth` is the cap (and the depth the engine keeps this step, depth_limit). The engine
then drops the drafter's cache entries, or keeps those of
the layers below an exit layer when the draft carries their states (Draft.exit_states).

Greedy chains are deterministic (draft_probs None); under sampling each token is drawn from the warped draft
distribution, which the draft carries, so the rejection verifier keeps the output distributed as plain sampling.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import OptionError
from ..models.base import CausalLM, Sublayers, needs_native_backend
from ..sampling import SamplingParams, probs_from_logits
from ..tree import Draft
from .base import Drafter
from .draft_length import draft_length


class SelfDrafter(Drafter):
    """A chain drafted level by level by `next_logits` (the subclass's drafting network), stopped by the length
    policy; `finish` makes the Draft."""

    needs_sublayers = True
    sizes: ClassVar[dict[str, str]] = {"depth": "depth"}

    def __init__(self, target: CausalLM, depth: int, length: str, threshold: float):
        if self.needs_sublayers and not target.runs_sublayers:
            raise needs_native_backend(target)
        if depth < 1:
            raise OptionError("need depth >= 1")
        self.target = target
        self.length = draft_length(length, depth, threshold)
        self.max_nodes = depth
        self.cache = None  # the target's KVCache of the current request

    def use_target_cache(self, cache) -> None:
        self.cache = cache

    @torch.inference_mode()
    def propose(self, context, params: SamplingParams, generator) -> Draft:
        root = len(context) - 1  # the root's position: the next free one in the target's cache
        self.begin(context)
        logits = self.next_logits(context[-1], root)  # [V]
        tokens, rows = [], []
        depth = self.length.depth_within(self.depth_limit)
        for level in range(1, depth + 1):
            token, row, confidence = pick(logits, params, generator)
            tokens.append(token)
            rows.append(row)
            if level == depth or not self.length.grow(confidence):
                break
            logits = self.next_logits(token, root + level)
        return self.finish(tokens, None if params.greedy else torch.stack(rows), root)

    def begin(self, context: list[int]) -> None:
        """Before the root's level (catch up on what the target committed since the last proposal)."""

    def next_logits(self, token: int, position: int) -> torch.Tensor:
        """[V] draft logits of the token after `token` at `position` (running the drafting network on it)."""
        raise NotImplementedError

    def finish(self, tokens: list[int], draft_probs: torch.Tensor | None, root: int) -> Draft:
        return Draft.chain(tokens, draft_probs)

    def run_target(self, token: int, position: int, sublayers: Sublayers) -> torch.Tensor:  # [1, d]
        """The target's `sublayers` on one token at `position`, seeing the committed context and every uncommitted
        entry (the root and the draft tokens before it)."""
        see_all = torch.ones(1, self.cache.pending + 1, dtype=torch.bool)
        ids, positions = torch.tensor([token]), torch.tensor([position])
        return self.target.forward_sublayers(self.cache, ids, positions, see_all, sublayers)

    def commit(self, verdict, draft, target_logits) -> None:
        if len(draft):  # an empty draft (trimmed, or a plain step of the governor) tells nothing about length
            self.length.update(len(verdict.accepted), len(draft))


def pick(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor, float]:
    """(token, the [V] distribution it was drawn from, its probability there) from [V] draft logits: the most
    likely token when greedy (its plain softmax probability is the confidence), else a sample of the warped
    distribution."""
    if params.greedy:
        probs = torch.softmax(logits.float(), -1)
        token = int(probs.argmax())
    else:
        probs = probs_from_logits(logits, params)
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token, probs, float(probs[token])
