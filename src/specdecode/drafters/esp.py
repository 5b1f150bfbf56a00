"""ESP, Embedding-Space Probing (arXiv 2603.17942, ICML 2026): training-free multi-token prediction from the
frozen target, probed inside the verification forward itself.

Each draft carries, besides its candidates, a chain of m probe nodes below the root. Their input is a
synthetic mask embedding, the mean of the prompt's token embeddings (the paper's default); probe k sits k
positions after the root and sees only the context and the probes before it, so the target's logits there
guess the token k + 1 positions after the root. Probes are PROBE nodes (tree.py): the target reads them,
no verifier accepts them, so they never reach the cache or the output. Next step, once `a` tokens were
accepted and the root moved a + 1 positions, probe a + d guesses the token at depth d below the new root; the
candidate tree takes the top-k tokens per depth, expands the `topk` best nodes per level and keeps the
`budget` best nodes by summed log-probability (the paper's dynamic tree with a high-probability pruning rule).

probe="nearest" keeps the interface to token ids: the probe is then the vocabulary token whose embedding is
closest (cosine) to the mean, an ordinary draft token the target may even accept.
The candidate tree is deterministic (draft_probs None): greedy and sampled decoding stay lossless.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import OptionError
from ..tree import PROBE, Draft, trie
from .base import Drafter, register


@register("esp")
class EmbeddingProbeDrafter(Drafter):
    variants = ({}, {"probes": 2, "topk": 2, "budget": 3}, {"probe": "nearest"})

    def __init__(self, target, probes: int = 4, topk: int = 2, budget: int = 8, probe: str = "mean"):
        if probes < 1 or topk < 1 or budget < 0 or probe not in ("mean", "nearest"):
            raise OptionError("need probes >= 1, topk >= 1, budget >= 0 and probe 'mean' or 'nearest'")
        self.target = target
        self.probes, self.topk, self.budget, self.probe = probes, topk, budget, probe
        self.max_nodes = budget + probes
        self.start([0], 0)

    def start(self, prompt_ids, capacity):
        mask_embedding = self.target.embed(torch.tensor(prompt_ids)).float().mean(0)  # [H]
        if self.probe == "mean":
            self.probe_token, self.probe_embedding = PROBE, mask_embedding
        else:
            self.probe_token, self.probe_embedding = self.nearest_token(mask_embedding), None
        self.probe_logits = torch.zeros(0)  # [D, V]: row d-1 guesses the token at depth d below the root
        self.draft: Draft | None = None
        self.probe_nodes: list[int] = []

    def propose(self, context, params, generator) -> Draft:
        paths = best_paths(self.probe_logits, self.topk, self.budget)
        merged = trie(paths + [[self.probe_token] * self.probes])
        draft, nodes = merged.draft(), merged.paths
        self.draft = dataclasses.replace(draft, probe_embedding=self.probe_embedding)
        self.probe_nodes = nodes[-1]
        return self.draft

    def commit(self, verdict, draft, target_logits) -> None:
        if draft is not self.draft:  # cut short at the end of a request
            self.probe_logits = torch.zeros(0)
            return
        rows = torch.tensor(self.probe_nodes) + 1  # probe k's row of target_logits guesses depth k + 1
        self.probe_logits = target_logits[rows][len(verdict.accepted) :]

    def nearest_token(self, vector: torch.Tensor) -> int:
        """The token whose input embedding has the highest cosine similarity with vector [H]."""
        best, best_score = 0, -float("inf")
        for start in range(0, self.target.vocab_size, 16384):  # chunks: the whole table in float32 is large
            ids = torch.arange(start, min(start + 16384, self.target.vocab_size))
            scores = torch.nn.functional.cosine_similarity(self.target.embed(ids).float(), vector[None], dim=-1)
            if float(scores.max()) > best_score:
                best, best_score = start + int(scores.argmax()), float(scores.max())
        return best


def best_paths(depth_logits: torch.Tensor, topk: int, budget: int) -> list[list[int]]:
    """Token paths of the `budget` best nodes of a tree whose depth-d children are the top-k tokens of
    depth_logits[d-1], each level expanding its `topk` best nodes (score: summed log-probability)."""
    paths: list[list[int]] = []
    scores: list[float] = []
    frontier: list[tuple[list[int], float]] = [([], 0.0)]
    for logits in depth_logits:
        logq, tokens = torch.topk(torch.log_softmax(logits.float(), -1), topk)  # [k]
        level = [(path + [t], score + lq) for path, score in frontier for lq, t in zip(logq.tolist(), tokens.tolist())]
        paths += [path for path, _ in level]
        scores += [score for _, score in level]
        frontier = sorted(level, key=lambda node: -node[1])[:topk]
    # Scores fall along every path and parents come first, so the best set is ancestor-closed.
    keep = sorted(sorted(range(len(paths)), key=lambda n: (-scores[n], n))[:budget])
    return [paths[n] for n in keep]
