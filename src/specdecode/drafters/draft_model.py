"""A smaller model with the same tokenizer drafts a chain or a tree, with its own KV cache.

The tree's shape is the option `structure`; one draft forward per level, over that level's expanded nodes.

- eagle2 (the default; EAGLE-2's dynamic tree, Li et al., 2024, arXiv 2406.16858, `topK_genrate`): every level
  gives each of the `topk` best nodes of the previous level (by path probability, the product of draft
  probabilities along the path) its `topk` most likely children; then all candidates are reranked and the
  `budget` best kept. topk=1 is the classic chain of `depth` tokens. Under sampling it sends `topk` chains
  instead: first tokens sampled without replacement from the draft distribution, then extended by sampling,
  each node carrying the distribution it was drawn from (Leviathan/Chen for topk=1). EAGLE-2's own code
  sends the deterministic tree at any temperature; `opt` and `sequoia` below do the lossless equivalents.
- opt (OPT-Tree, Wang et al., 2024, arXiv 2406.17276): the same best-first growth with the width tied to the
  node budget n: every level, the frontier nodes still among the n best found so far (only they can have
  children among the final n; OPT-Tree expands all n, to the same tree) get their n most likely children.
  The tree is the n best nodes, so E[accepted length] = the sum of their path probabilities; growth stops
  when a level adds less than `min_gain` to it (OPT-Tree's threshold) or at `depth`. Under sampling it ranks
  by the warped (temperature, top-k, top-p) draft distribution and sends the same deterministic tree:
  draft_probs None, and the point-mass rule keeps it lossless.
- sequoia (Chen et al., 2024, arXiv 2402.12374): a static shape from Sequoia's dynamic program over `budget`
  nodes and `depth` levels, given `accept`, the probability that a node's r-th ranked child is the accepted
  one (measured by `specdecode tune`, or the default). Greedy: each node's children are its top-b tokens.
  Sampling: they are sampled without replacement, each carrying its renormalized distribution, so the
  rejection verifier stays lossless (SpecTree's rule).

The option `length` (fixed | heuristic | confidence | thompson, see draft_length.py) decides, level by level,
whether to grow deeper; `depth` is its cap. Greedy trees carry draft_probs None.

The option `lookup` (SuffixDecoding's hybrid, Oliaro et al., 2024): when the context's last `lookup` or more
tokens occurred before (in this request or earlier outputs, suffix.py), that match's speculation tree (up to
`lookup_nodes` nodes) is sent instead and the draft model does not run this step; it catches up on the skipped
tokens at its next proposal. Copy-heavy text (summaries, retrieval answers, code edits) is then drafted for free
and further ahead than the draft model's depth. 0 (the default) turns it off.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..errors import SpecDecodeError
from ..models.base import CausalLM, prefill
from ..sampling import SamplingParams, probs_from_logits
from ..tree import Draft, depths, sequoia_tree
from .base import Drafter, register
from .draft_length import draft_length
from .suffix import SuffixDrafter

STRUCTURES = ("eagle2", "opt", "sequoia")


@register("draft")
class DraftModelDrafter(Drafter):
    needs_draft_model = True
    variants = (
        {}, {"depth": 3, "topk": 1}, {"depth": 3, "topk": 3, "budget": 7}, {"depth": 1, "topk": 1},
        # Structures and length policies paired up, to keep the matrix short.
        {"structure": "opt", "budget": 6, "depth": 5, "min_gain": 0.05, "length": "heuristic"},
        {"structure": "sequoia", "budget": 6, "depth": 4, "length": "thompson"},
        {"topk": 1, "depth": 6, "length": "confidence", "threshold": 0.3},
        {"topk": 1, "depth": 4, "lookup": 2, "lookup_nodes": 6},
    )
    tune_grid = (
        {"depth": 3, "topk": 1}, {"depth": 5, "topk": 1}, {"depth": 4, "topk": 2, "budget": 8},
        {"structure": "opt", "budget": 8, "depth": 6}, {"structure": "opt", "budget": 16, "depth": 8},
        {"structure": "sequoia", "budget": 8, "depth": 5}, {"structure": "sequoia", "budget": 16, "depth": 6},
        {"topk": 1, "depth": 8, "length": "confidence", "threshold": 0.4},
        {"topk": 1, "depth": 8, "length": "confidence", "threshold": 0.4, "lookup": 4},
        {"structure": "opt", "budget": 8, "depth": 8, "lookup": 4},
        {"topk": 1, "depth": 6, "lookup": 3, "lookup_nodes": 12},
    )

    def __init__(
        self, target: CausalLM, draft_model: CausalLM, structure: str = "eagle2", depth: int = 4, topk: int = 2,
        budget: int = 8, length: str = "fixed", threshold: float = 0.4, min_gain: float = 0.1,
        accept: str = "0.7,0.1,0.04,0.02", lookup: int = 0, lookup_nodes: int = 16,
    ):
        if structure not in STRUCTURES:
            raise SpecDecodeError(f"unknown draft structure '{structure}'.", f"Use one of: {', '.join(STRUCTURES)}.")
        if depth < 1 or topk < 1 or budget < 0 or (structure != "eagle2" and budget < 1) or lookup < 0:
            raise TypeError("need depth >= 1, topk >= 1, budget >= 0 (>= 1 for opt and sequoia), lookup >= 0")
        accept_by_rank = _probabilities(accept)
        check_same_vocabulary(target, draft_model)
        self.model = draft_model
        self.structure, self.depth, self.topk, self.min_gain = structure, depth, topk, min_gain
        self.length = draft_length(length, depth, threshold)
        if structure == "eagle2":
            self.width = topk
            self.max_nodes = depth * topk  # every node the tree (or the sampled chains) can grow
            self.budget = min(budget, self.max_nodes) if budget else self.max_nodes
        else:
            self.width = budget
            self.budget = self.max_nodes = budget
        self.shape = sequoia_tree(budget, depth, accept_by_rank)[1] if structure == "sequoia" else None
        self.cache = None
        self.lookup = lookup
        self.retrieval = SuffixDrafter(target, max_nodes=lookup_nodes) if lookup else None
        self.max_nodes = max(self.max_nodes, lookup_nodes if lookup else 0)
        self.looked_up = False  # the current draft came from the retrieval, not the draft model

    def start(self, prompt_ids, capacity):
        self.cache = self.model.new_cache(capacity + self.depth * self.width + 1)
        if self.retrieval:
            self.retrieval.start(prompt_ids, capacity)

    def propose(self, context, params: SamplingParams, generator) -> Draft:
        if self.retrieval:
            match_len, found = self.retrieval.lookup(context)
            self.looked_up = match_len >= self.lookup and len(found) > 0
            if self.looked_up:
                return found
        return self.model_draft(context, params, generator)

    def model_draft(self, context, params: SamplingParams, generator) -> Draft:
        cache = self.cache
        cache.truncate(len(context) - 1)  # drop what the target did not accept; keep the shared prefix
        root_logits = prefill(self.model, cache, context[cache.length :])  # [V]
        grow = _TreeGrowth(self.model, cache, len(context), params, self.length)
        depth = self.length.depth()
        if self.structure == "sequoia":
            draft = grow.static_tree(root_logits, self.shape, depth, generator)
        elif self.structure == "eagle2" and not params.greedy:
            draft = grow.sampled_chains(root_logits, depth, self.topk, generator)
        else:
            prune = self.structure == "opt"
            min_gain = self.min_gain if prune else None
            draft = grow.best_first(root_logits, depth, self.width, self.budget, prune, min_gain)
        cache.discard()
        return draft

    def commit(self, verdict, draft, target_logits) -> None:
        if self.retrieval:
            self.retrieval.commit(verdict, draft, target_logits)
        if not self.looked_up:
            drafted_depth = int(depths(draft.parents).max()) if len(draft) else 0
            self.length.update(len(verdict.accepted), drafted_depth)


class _TreeGrowth:
    """Grows a draft tree with the draft model, one forward per level over the nodes that level expands."""

    def __init__(self, model: CausalLM, cache, context_len: int, params: SamplingParams, length):
        self.model, self.cache, self.context_len = model, cache, context_len
        self.params, self.length = params, length
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

    def ranking_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] draft probabilities that rank candidates: plain softmax when greedy (the warped greedy
        distribution is one-hot), the distribution sampled from otherwise."""
        return torch.softmax(logits.float(), -1) if self.params.greedy else probs_from_logits(logits, self.params)

    def best_first(self, root_logits, depth: int, width: int, budget: int, prune: bool, min_gain) -> Draft:
        """EAGLE-2's growth (prune False, min_gain None) or OPT-Tree's (prune True): see the module docstring."""
        weights: list[float] = []  # node -> path probability
        frontier, frontier_probs, expected = [-1], self.ranking_probs(root_logits)[None], 0.0
        for level in range(1, depth + 1):
            width = min(width, frontier_probs.shape[-1])
            child_probs, child_tokens = torch.topk(frontier_probs, width, dim=-1)  # [F, width]
            new_nodes = []
            for row, parent in enumerate(frontier):
                parent_weight = 1.0 if parent < 0 else weights[parent]
                for q, token in zip(child_probs[row].tolist(), child_tokens[row].tolist()):
                    if q > 0:  # top-k / top-p may leave fewer than `width` candidates
                        new_nodes.append(self.add(token, parent))
                        weights.append(parent_weight * q)
            kept = set(_best(weights, budget))
            gain, expected = sum(weights[n] for n in kept) - expected, sum(weights[n] for n in kept)
            frontier = [n for n in _best(weights, len(weights), new_nodes) if n in kept or not prune][:width]
            if (
                level == depth or not frontier or (min_gain is not None and gain < min_gain)
                or not self.length.grow(weights[frontier[0]])
            ):
                break
            frontier_probs = self.ranking_probs(self.expand(frontier, level))
        # Weights fall along every path and parents have smaller indices, so the best set is ancestor-closed.
        return self.subtree(sorted(_best(weights, budget)))

    def sampled_chains(self, root_logits, depth, topk, generator) -> Draft:
        root_probs = probs_from_logits(root_logits, self.params)  # [V]
        probs_rows: list[torch.Tensor] = []
        frontier, weights = [], []
        remaining = root_probs.clone()
        for _ in range(min(topk, int((root_probs > 0).sum()))):  # siblings without replacement
            q = remaining / remaining.sum()
            token = int(torch.multinomial(q, 1, generator=generator))
            frontier.append(self.add(token, -1))
            weights.append(float(q[token]))
            probs_rows.append(q)
            remaining[token] = 0
        for level in range(1, depth):
            if not self.length.grow(max(weights)):
                break
            level_probs = probs_from_logits(self.expand(frontier, level), self.params)  # [F, V]
            tokens = torch.multinomial(level_probs, 1, generator=generator)[:, 0].tolist()
            weights = [w * float(row[t]) for w, row, t in zip(weights, level_probs, tokens)]
            frontier = [self.add(t, parent) for t, parent in zip(tokens, frontier)]
            probs_rows.extend(level_probs)
        order = sorted(range(len(self.tokens)), key=lambda n: (len(self.ancestors[n]), n))  # parents first
        return self.subtree(order, torch.stack(probs_rows))

    def static_tree(self, root_logits, shape: list[int], depth: int, generator) -> Draft:
        """Sequoia's shape (parents, breadth-first, siblings by rank) filled level by level: a node's b
        children are its top-b draft tokens (greedy) or b tokens sampled without replacement."""
        kids: dict[int, list[int]] = {}  # shape node (-1 = root) -> its children, by rank
        for child, parent in enumerate(shape):
            kids.setdefault(parent, []).append(child)
        node_of = {-1: -1}  # shape node -> draft node (shape nodes whose parent had too few candidates drop out)
        probs_rows: list[torch.Tensor] = []
        level_nodes, level_probs, weights = [-1], self.ranking_probs(root_logits)[None], {-1: 1.0}
        for level in range(1, depth + 1):
            next_level = []
            for row, shape_node in enumerate(level_nodes):
                children = kids.get(shape_node, [])
                picks = self.pick_children(level_probs[row], len(children), generator)
                for child, (token, q_row, q) in zip(children, picks):
                    node_of[child] = self.add(token, node_of[shape_node])
                    weights[child] = weights[shape_node] * q
                    probs_rows.append(q_row)
                    next_level.append(child)
            level_nodes = [s for s in next_level if kids.get(s)]
            if not level_nodes or level == depth or not self.length.grow(max(weights[s] for s in next_level)):
                break
            level_probs = self.ranking_probs(self.expand([node_of[s] for s in level_nodes], level))
        probs = None if self.params.greedy else torch.stack(probs_rows)
        return self.subtree(list(range(len(self.tokens))), probs)

    def pick_children(self, probs: torch.Tensor, count: int, generator) -> list[tuple[int, torch.Tensor, float]]:
        """(token, the distribution it was drawn from, its probability) for up to `count` children of a node
        whose [V] draft distribution is `probs`: the top tokens when greedy, else sampled without replacement."""
        picks = []
        remaining = probs.clone()
        for _ in range(min(count, int((probs > 0).sum()))):
            q = remaining / remaining.sum()
            token = int(q.argmax()) if self.params.greedy else int(torch.multinomial(q, 1, generator=generator))
            picks.append((token, q, float(probs[token])))
            remaining[token] = 0
        return picks

    def subtree(self, nodes: list[int], draft_probs: torch.Tensor | None = None) -> Draft:
        """The draft over these nodes, listed parents first; node indices renumbered in that order."""
        index = {n: i for i, n in enumerate(nodes)}
        parents = [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in nodes]
        probs = None if draft_probs is None else draft_probs[torch.tensor(nodes)]
        return Draft(torch.tensor([self.tokens[n] for n in nodes]), torch.tensor(parents), probs)


def _probabilities(text) -> tuple[float, ...]:
    try:
        values = tuple(float(a) for a in str(text).split(","))
    except ValueError:
        values = (-1.0,)
    if not all(0 <= a <= 1 for a in values):
        raise TypeError(f"accept={text} is not comma-separated probabilities (e.g. accept=0.7,0.1,0.04)")
    return values


def _best(weights: list[float], n: int, among: list[int] | None = None) -> list[int]:
    """The n nodes (of `among`, default all) with the largest weights, best first; ties to the older node."""
    candidates = range(len(weights)) if among is None else among
    return sorted(candidates, key=lambda node: (-weights[node], node))[:n]


@lru_cache(maxsize=8)
def _same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def check_same_vocabulary(target: CausalLM, draft: CausalLM) -> None:
    # Cached: the server builds a drafter per request, and comparing two 150k-entry vocabularies takes a while.
    if not _same_vocabulary(target.tokenizer, draft.tokenizer):
        raise SpecDecodeError(
            f"draft model {draft.name} uses a different tokenizer than the target {target.name}.",
            "Use a draft model of the same family (same tokenizer), or a drafter for any tokenizer: "
            "--drafter slem (string-level exact match), tli (token-level intersection) or slrs (string-level "
            "rejection sampling).",
        )
