"""A smaller model with the same tokenizer drafts a chain (topk=1) or a tree, with its own KV cache.

Greedy: a deterministic top-k tree grown level by level (each level expands the `topk` best nodes by cumulative
log-probability; EAGLE-2's rule) and cut to the `budget` best nodes; draft_probs None.
Sampling: topk chains whose first tokens are sampled without replacement from the draft distribution and then
extended by sampling; each node carries the distribution it was drawn from (a shape fixed before sampling, so
the rejection verifier stays lossless). topk=1 is the classic Leviathan/Chen chain.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..errors import SpecDecodeError
from ..models.base import CausalLM, prefill
from ..sampling import SamplingParams, probs_from_logits
from ..tree import Draft
from .base import Drafter, register


@register("draft")
class DraftModelDrafter(Drafter):
    needs_draft_model = True
    variants = ({}, {"depth": 3, "topk": 1}, {"depth": 3, "topk": 3, "budget": 7}, {"depth": 1, "topk": 1})

    def __init__(self, target: CausalLM, draft_model: CausalLM, depth: int = 4, topk: int = 2, budget: int = 8):
        if depth < 1 or topk < 1 or budget < 0:
            raise TypeError("need depth >= 1, topk >= 1, budget >= 0")
        check_same_vocabulary(target, draft_model)
        self.model = draft_model
        self.depth, self.topk = depth, topk
        self.max_nodes = depth * topk  # every node the tree can grow
        self.budget = min(budget, self.max_nodes) if budget else self.max_nodes
        self.cache = None

    def start(self, prompt_ids, capacity):
        self.cache = self.model.new_cache(capacity + self.depth * self.topk + 1)

    def propose(self, context, params: SamplingParams, generator) -> Draft:
        cache = self.cache
        cache.truncate(len(context) - 1)  # drop what the target did not accept; keep the shared prefix
        root_logits = prefill(self.model, cache, context[cache.length :])  # [V]
        grow = _TreeGrowth(self.model, cache, len(context))
        if params.greedy:
            draft = grow.top_k_tree(root_logits, self.depth, self.topk, self.budget)
        else:
            draft = grow.sampled_chains(root_logits, self.depth, self.topk, params, generator)
        cache.discard()
        return draft


class _TreeGrowth:
    """Grows a draft tree with the draft model, one forward per level over the current frontier."""

    def __init__(self, model: CausalLM, cache, context_len: int):
        self.model, self.cache, self.context_len = model, cache, context_len
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.slot: dict[int, int] = {}  # node -> its offset among the cache's uncommitted entries
        self.ancestors: list[list[int]] = []  # node -> its ancestors (excluding itself)

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.ancestors.append([] if parent < 0 else self.ancestors[parent] + [parent])
        return len(self.tokens) - 1

    def expand(self, frontier: list[int], depth: int) -> torch.Tensor:
        """Forward the frontier nodes (all at `depth`); return their [F, V] next-token logits."""
        pending = self.cache.pending
        f = len(frontier)
        mask = torch.zeros(f, pending + f, dtype=torch.bool)  # [F, pending+F]
        for row, node in enumerate(frontier):
            mask[row, [self.slot[a] for a in self.ancestors[node]]] = True
            mask[row, pending + row] = True
            self.slot[node] = pending + row
        ids = torch.tensor([self.tokens[n] for n in frontier])
        positions = torch.full((f,), self.context_len + depth - 1)
        return self.model.forward(self.cache, ids, positions, mask)

    def top_k_tree(self, root_logits: torch.Tensor, depth: int, topk: int, budget: int) -> Draft:
        scores: list[float] = []
        frontier, frontier_logits, frontier_scores = [-1], root_logits[None], [0.0]
        for level in range(1, depth + 1):
            logq, tok = torch.topk(torch.log_softmax(frontier_logits.float(), -1), topk, dim=-1)  # [F, k]
            new_nodes = []
            for row, parent in enumerate(frontier):
                for lq, t in zip(logq[row].tolist(), tok[row].tolist()):
                    new_nodes.append(self.add(t, parent))
                    scores.append(frontier_scores[row] + lq)
            if level == depth:
                break
            frontier = sorted(new_nodes, key=lambda n: (-scores[n], n))[:topk]
            frontier_scores = [scores[n] for n in frontier]
            frontier_logits = self.expand(frontier, level)
        # Scores fall along every path and parents have smaller indices, so this top set is ancestor-closed.
        keep = sorted(sorted(range(len(scores)), key=lambda n: (-scores[n], n))[:budget])
        return self.subtree(keep)

    def sampled_chains(self, root_logits, depth, topk, params, generator) -> Draft:
        root_probs = probs_from_logits(root_logits, params)  # [V]
        probs_rows: list[torch.Tensor] = []
        frontier = []
        remaining = root_probs.clone()
        for _ in range(min(topk, int((root_probs > 0).sum()))):  # siblings without replacement
            q = remaining / remaining.sum()
            token = int(torch.multinomial(q, 1, generator=generator))
            frontier.append(self.add(token, -1))
            probs_rows.append(q)
            remaining[token] = 0
        for level in range(1, depth):
            level_probs = probs_from_logits(self.expand(frontier, level), params)  # [F, V]
            tokens = torch.multinomial(level_probs, 1, generator=generator)[:, 0].tolist()
            frontier = [self.add(t, parent) for t, parent in zip(tokens, frontier)]
            probs_rows.extend(level_probs)
        order = sorted(range(len(self.tokens)), key=lambda n: (len(self.ancestors[n]), n))  # parents first
        return self.subtree(order, torch.stack(probs_rows))

    def subtree(self, nodes: list[int], draft_probs: torch.Tensor | None = None) -> Draft:
        """The draft over these nodes, listed parents first; node indices renumbered in that order."""
        index = {n: i for i, n in enumerate(nodes)}
        parents = [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in nodes]
        probs = None if draft_probs is None else draft_probs[torch.tensor(nodes)]
        return Draft(torch.tensor([self.tokens[n] for n in nodes]), torch.tensor(parents), probs)


@lru_cache(maxsize=8)
def _same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def check_same_vocabulary(target: CausalLM, draft: CausalLM) -> None:
    # Cached: the server builds a drafter per request, and comparing two 150k-entry vocabularies takes a while.
    if not _same_vocabulary(target.tokenizer, draft.tokenizer):
        raise SpecDecodeError(
            f"draft model {draft.name} uses a different tokenizer than the target {target.name}.",
            "Use a draft model of the same family (same tokenizer); heterogeneous-vocabulary drafters "
            "(token-level intersection, string-level exact match) are planned for such pairs.",
        )
