"""Tree-growth strategies for drafters that can score a frontier of nodes (a draft model, an EAGLE head): the tree's
shape is the option `structure`; one `expand` per level, over that level's expanded nodes. TreeStrategy holds
the options every such drafter shares (structure, depth, topk, budget, length, threshold, min_gain, accept) and
grows one proposal; the drafter supplies the root's logits and the expand callback.

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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import SpecDecodeError
from ..sampling import SamplingParams, probs_from_logits
from ..tree import Draft, depths, sequoia_tree
from ..verify import Verdict
from .draft_length import draft_length

STRUCTURES = ("eagle2", "opt", "sequoia")
Expand = Callable[["TreeGrowth", list[int], int], torch.Tensor]  # (tree, frontier nodes, their depth) -> [F, V]


class TreeStrategy:
    """The tree options a model-based drafter exposes, checked once; grow() drafts one proposal with them."""

    def __init__(
        self, structure: str = "eagle2", depth: int = 4, topk: int = 2, budget: int = 8, length: str = "fixed",
        threshold: float = 0.4, min_gain: float = 0.1, accept: str = "0.7,0.1,0.04,0.02",
    ):
        if structure not in STRUCTURES:
            raise SpecDecodeError(f"unknown draft structure '{structure}'.", f"Use one of: {', '.join(STRUCTURES)}.")
        if depth < 1 or topk < 1 or budget < 0 or (structure != "eagle2" and budget < 1):
            raise SpecDecodeError(
                f"bad tree options depth={depth}, topk={topk}, budget={budget} (structure {structure}).",
                "Use depth >= 1, topk >= 1 and budget >= 0 (>= 1 for opt and sequoia).",
            )
        accept_by_rank = _probabilities(accept)
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

    @property
    def expanded_nodes(self) -> int:
        """Most nodes one proposal expands (a drafter's cache room for them)."""
        return self.depth * self.width

    def grow(
        self, expand: Expand, root_logits: torch.Tensor, params: SamplingParams, generator, limit: int | None = None
    ) -> Draft:
        """One proposal below the root whose next-token logits are root_logits [V], at most `limit` deep (the depth
        the engine keeps this step: levels past it would be expanded for nothing)."""
        grow = TreeGrowth(expand, params, self.length)
        depth = self.length.depth_within(limit)
        if self.structure == "sequoia":
            return grow.static_tree(root_logits, self.shape, depth, generator)
        if self.structure == "eagle2" and not params.greedy:
            return grow.sampled_chains(root_logits, depth, self.topk, generator)
        prune = self.structure == "opt"
        return grow.best_first(root_logits, depth, self.width, self.budget, prune, self.min_gain if prune else None)

    def update(self, verdict: Verdict, draft: Draft) -> None:
        """Let the length policy learn from the verdict on a draft this strategy grew."""
        if len(draft):  # an empty draft (trimmed, or a step the engine ran plain) tells nothing about depth
            self.length.update(len(verdict.accepted), int(depths(draft.parents).max()))


class TreeGrowth:
    """One proposal's tree, grown level by level: `expand(tree, frontier, depth)` returns the [F, V] next-token
    logits of the frontier nodes (all at `depth`; a draft model runs one forward over them, an EAGLE head one
    head step). Nodes are numbered in creation order; the strategies below call expand once per level."""

    def __init__(self, expand: Expand, params: SamplingParams, length):
        self.expand_frontier, self.params, self.length = expand, params, length
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.ancestors: list[list[int]] = []  # node -> its ancestors (excluding itself), root side first

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.ancestors.append([] if parent < 0 else self.ancestors[parent] + [parent])
        return len(self.tokens) - 1

    def expand(self, frontier: list[int], depth: int) -> torch.Tensor:  # [F, V]
        return self.expand_frontier(self, frontier, depth)

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
        raise SpecDecodeError(
            f"accept={text} is not comma-separated probabilities.", "Write it as -o accept=0.7,0.1,0.04."
        )
    return values


def _best(weights: list[float], n: int, among: list[int] | None = None) -> list[int]:
    """The n nodes (of `among`, default all) with the largest weights, best first; ties to the older node."""
    candidates = range(len(weights)) if among is None else among
    return sorted(candidates, key=lambda node: (-weights[node], node))[:n]
