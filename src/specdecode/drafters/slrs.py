"""SLRS, String-Level Rejection Sampling (Timor et al., 2025, arXiv 2502.05202, Algorithm 3): the proposal for the
next target token is a distribution over strings: psi(t) sums the draft model's probability of t's string over
the draft tokenizations that spell it, so a target token the draft writes in several of its own tokens (" Fibonacci"
as " Fibon" + "acci", where " Fibon" is no target token) gets the mass TLI (tli.py) leaves out. The target verifies with ordinary rejection sampling
against psi.

What is exact here, and why it stays lossless. The proposal process is: sample draft tokens one at a time and stop
at the first draft-token boundary where the text so far is a target token's string; that token is the proposal.
psi(t) is the probability of stopping at t, summed over every draft path. A path can pass any number of boundaries
that are not target strings, so psi(t) is a sum over exponentially many paths (the paper's Lemma 3.1); we compute
it exactly over a bounded tree: the draft's next-token distribution gives every one-token path, and the `expand`
likeliest unfinished paths (draft text that is not a target token but begins one) are run one more draft token,
best first by path probability, in rounds (one draft forward runs a round's paths together). Paths that leave that tree are dropped and psi is renormalised over what the tree
reaches. The tree depends only on the draft model's own probabilities, so psi is the exact distribution the
proposal is drawn from, and the rejection verifier (accept t with min(1, p(t)/psi(t)), else resample from
norm(max(p - psi, 0))) emits exactly the target's distribution. With expand=0 this is TLI. The next proposal of
the chain continues from the draft path that spelled the chosen token (drawn by its probability among that token's
paths), which is extra randomness independent of the verifier's draws: each level stays an exact single-draft
rejection step.

The paper states SLRS as a string-level acceptance over psi; its full psi (every tokenization, every target token)
is only practical for drafters with very short tokens (byte-level drafters), which is why the tree is bounded.
"""

from __future__ import annotations

import heapq
from itertools import count

import torch

from ..errors import OptionError
from ..sampling import SamplingParams
from .base import register
from .tli import Path, Proposal, TLIDrafter


@register("slrs")
class SLRSDrafter(TLIDrafter):
    variants = ({}, {"depth": 3, "expand": 16})
    tune_grid = ({"depth": 4, "expand": 2}, {"depth": 6, "expand": 8})

    def __init__(self, target, draft_model, depth: int = 6, length: str = "fixed", threshold: float = 0.4,
                 expand: int = 4):
        super().__init__(target, draft_model, depth, length, threshold)
        if expand < 0:
            raise OptionError("need expand >= 0")
        self.expand = expand

    def tree_nodes_per_level(self) -> int:
        return 1 + self.expand

    def propose_level(self, logits: torch.Tensor, node: int, params: SamplingParams) -> Proposal:
        """TLI's proposal plus the target tokens reached by longer draft paths (see the module docstring)."""
        single = super().propose_level(logits, node, params)
        draft_probs = self.draft_distribution(logits, params)  # [Vd]
        mass = single.mass.clone()  # [Vt]
        spelled: dict[int, list[Path]] = {}
        order = count()  # ties in the heap go to the older entry
        unfinished = self.bridge.extendable[: draft_probs.shape[0]] & (draft_probs > 0)
        top = torch.topk(draft_probs * unfinished, min(self.expand, int(unfinished.sum())))
        heap = [(-float(w), next(order), self.bridge.draft_bytes[d], node, d)
                for w, d in zip(top.values.tolist(), top.indices.tolist())]
        heapq.heapify(heap)
        budget = self.expand
        while heap and budget > 0:  # rounds: the likeliest unfinished paths, run together in one forward
            batch = [heapq.heappop(heap) for _ in range(min(budget, len(heap)))]
            budget -= len(batch)
            batch_logits = self.view.grow([entry[4] for entry in batch], [entry[3] for entry in batch])  # [F, Vd]
            first = len(self.view.nodes) - len(batch)
            for row, (negative_weight, _, prefix, _, _) in enumerate(batch):
                here_probs = self.draft_distribution(batch_logits[row], params)  # [Vd]
                for weight, text, draft_token, finished in self.continuations(prefix, -negative_weight, here_probs):
                    if finished:
                        target_token = self.bridge.target_id[text]
                        mass[target_token] += weight
                        spelled.setdefault(target_token, []).append((weight, first + row, draft_token))
                    else:
                        heapq.heappush(heap, (-weight, next(order), text, first + row, draft_token))

        def paths_of(target_token: int) -> list[Path]:
            return single.paths_of(target_token) + spelled.get(target_token, [])

        return Proposal(mass, paths_of)

    def continuations(self, prefix: bytes, weight: float, draft_probs: torch.Tensor):
        """(path probability, text, draft token, finished) for every draft token after the unfinished text `prefix`
        that keeps it on the way to a target token: finished when the text is now a target token's string."""
        bridge, seen = self.bridge, set()
        for target_text in bridge.target_strings_after(prefix):
            rest = target_text[len(prefix) :]
            for cut in range(1, len(rest) + 1):
                text = prefix + rest[:cut]
                finished = cut == len(rest)
                if text in seen or (not finished and text in bridge.target_id):
                    continue  # counted once; a target string on the way is a stop, handled as its own target_text
                seen.add(text)
                for draft_token in bridge.draft_ids_of.get(rest[:cut], []):
                    if draft_token < draft_probs.shape[0] and float(draft_probs[draft_token]) > 0:
                        yield weight * float(draft_probs[draft_token]), text, draft_token, finished
