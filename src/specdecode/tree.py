"""A draft is data: tokens plus parent indices (plus draft probabilities, or None).

Node indices count draft tokens 0..N-1; parent -1 is the root, the last committed token, whose target logits
come first in the verification forward. Parents always precede their children (topological order), so a chain
is the tree with parents [-1, 0, 1, ...]. All functions here are pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

PROBE = -1  # the token of a probe node: the target reads its logits, no verifier ever accepts it


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [N] int64 token ids
    parents: torch.Tensor  # [N] int64, -1 = root; parents[i] < i
    # [N, V] float32: the distribution node i was sampled from, given its parent and its earlier-tried siblings.
    # None for deterministic drafts (n-gram lookup, top-k trees): verification then uses q = 1 for the drafted token.
    draft_probs: torch.Tensor | None = None
    # [H]: the input embedding of every PROBE node (probing the target in embedding space, as ESP does).
    probe_embedding: torch.Tensor | None = None
    # Self-speculation (Kangaroo, EESD): [N+1, H] the target's residual stream entering decoder layer `exit_layer`
    # for the root and every node, which the drafter computed by running the target's first layers itself over the
    # target's KV cache, leaving those layers' entries uncommitted in slots root, node 0, ... N-1. Verification
    # then runs only the layers from exit_layer on, over the same slots (models.base.tree_request).
    exit_states: torch.Tensor | None = None
    exit_layer: int = 0

    def __post_init__(self):
        n = self.tokens.shape[0]
        if self.parents.shape != (n,):
            raise ValueError(f"parents has shape {tuple(self.parents.shape)}, tokens has {n} nodes")
        if n and not bool((self.parents < torch.arange(n)).all()):
            raise ValueError("every parent index must precede its child")
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError("draft_probs needs one row per draft token")
        if self.exit_states is not None and self.exit_states.shape[0] != n + 1:
            raise ValueError("exit_states needs one row for the root and one per draft token")

    @staticmethod
    def empty() -> "Draft":
        return Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @staticmethod
    def chain(tokens: list[int] | torch.Tensor, draft_probs: torch.Tensor | None = None) -> "Draft":
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        return Draft(tokens, torch.arange(tokens.shape[0]) - 1, draft_probs)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def depth_limited(self, max_depth: int) -> "Draft":
        """The sub-tree of nodes at depth <= max_depth (depth of a root child = 1)."""
        keep = depths(self.parents) <= max_depth  # [N] bool
        return self if bool(keep.all()) else self.subset(keep.nonzero().flatten())

    def first(self, n: int) -> "Draft":
        """The first n nodes: a sub-tree (parents come before children), and for every node a prefix of its
        children in their order, so a draft sampled without replacement stays a valid one."""
        return self if len(self) <= n else self.subset(torch.arange(n))

    def subset(self, nodes: torch.Tensor) -> "Draft":
        """The draft over `nodes` [M] (indices), renumbered in that order; each node's parent is listed before it.
        Exit states stay only for a leading run of nodes (0..M-1): their cache slots are then still in place."""
        new_index = torch.full((len(self) + 1,), -1, dtype=torch.long)  # slot 0 = root
        new_index[nodes + 1] = torch.arange(nodes.shape[0])
        parents = new_index[self.parents[nodes] + 1]
        probs = None if self.draft_probs is None else self.draft_probs[nodes]
        leading = torch.equal(nodes, torch.arange(nodes.shape[0]))
        states = self.exit_states[: nodes.shape[0] + 1] if self.exit_states is not None and leading else None
        return Draft(self.tokens[nodes], parents, probs, self.probe_embedding, states, self.exit_layer if leading else 0)


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[N] depth of each node; a child of the root has depth 1."""
    out = torch.zeros(parents.shape[0], dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        out[i] = 1 if p < 0 else out[p] + 1
    return out


def with_root(parents: torch.Tensor) -> torch.Tensor:
    """Parents over the verification layout [root, node 0, ..., node N-1]: index 0 is the root."""
    return torch.cat([torch.tensor([-1]), parents + 1])


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: mask[i, j] is True when j is i or an ancestor of i (what node i may attend to)."""
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def children(parents: torch.Tensor) -> list[list[int]]:
    """Children of each node, in index order (the order siblings were drafted and are tried)."""
    out: list[list[int]] = [[] for _ in range(parents.shape[0])]
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            out[p].append(i)
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the first node below the root down to `node` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@dataclass
class Trie:
    """Token sequences merged where they share prefixes. Nodes in creation order (parents first)."""

    tokens: list[int]
    parents: list[int]  # -1 = root
    counts: list[int]  # how many sequences pass through each node
    paths: list[list[int]]  # the node index of every token of every sequence

    def draft(self) -> Draft:
        return Draft(torch.tensor(self.tokens, dtype=torch.long), torch.tensor(self.parents, dtype=torch.long))


def trie(sequences: list[list[int]]) -> Trie:
    tokens: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    nodes: list[list[int]] = []
    for seq in sequences:
        parent, path = -1, []
        for tok in seq:
            key = (parent, tok)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                counts.append(0)
            parent = index[key]
            counts[parent] += 1
            path.append(parent)
        nodes.append(path)
    return Trie(tokens, parents, counts, nodes)


def from_sequences(sequences: list[list[int]]) -> Draft:
    """A deterministic draft tree (a trie) that merges token sequences sharing prefixes."""
    return trie(sequences).draft()


def sequoia_tree(budget: int, depth: int, accept: tuple[float, ...]) -> tuple[float, list[int]]:
    """Sequoia's dynamic program (Chen et al., 2024, arXiv 2402.12374): the tree shape of at most `budget` nodes
    below the root, at most `depth` deep, that maximizes the expected tokens per step, 1 + sum over nodes of the
    product of accept[rank] along the node's path, where accept[r] is the probability that a node's child of
    rank r (0 = the draft's first choice) is the accepted one. Returns (that expectation, parents in
    breadth-first order, siblings in rank order)."""
    best, children_sizes = _sequoia_table(budget, depth, tuple(accept))
    size = max(range(1, budget + 2), key=lambda m: (best[depth][m], -m))
    parents: list[int] = []
    queue = [(-1, depth, size)]  # (node, depth left below it, nodes in its subtree)
    for node, left, subtree in queue:  # the queue grows while we walk it: breadth-first
        for child_size in children_sizes[left][subtree]:
            parents.append(node)
            queue.append((len(parents) - 1, left - 1, child_size))
    return best[depth][size], parents


@lru_cache(maxsize=16)
def _sequoia_table(budget: int, depth: int, accept: tuple[float, ...]):
    """best[l][m]: the value of the best subtree of exactly m nodes (its root included) and l levels below its
    root; children_sizes[l][m]: the subtree sizes of its children, by rank. A knapsack over the ranks."""
    none = float("-inf")
    best = [[none] * (budget + 2) for _ in range(depth + 1)]
    children_sizes: list[list[tuple[int, ...]]] = [[()] * (budget + 2) for _ in range(depth + 1)]
    for left in range(depth + 1):
        best[left][1] = 1.0
        if left == 0:
            continue
        forest = [0.0] + [none] * budget  # forest[n]: children ranks 0..r using n nodes in all
        forest_sizes: list[tuple[int, ...]] = [()] * (budget + 1)
        for rank_accept in accept:
            grown, grown_sizes = [none] * (budget + 1), [()] * (budget + 1)
            for n in range(1, budget + 1):
                for y in range(1, n + 1):
                    value = forest[n - y] + rank_accept * best[left - 1][y]
                    if value > grown[n]:
                        grown[n], grown_sizes[n] = value, forest_sizes[n - y] + (y,)
            forest, forest_sizes = grown, grown_sizes
            for n in range(1, budget + 1):
                if 1.0 + forest[n] > best[left][n + 1]:
                    best[left][n + 1] = 1.0 + forest[n]
                    children_sizes[left][n + 1] = forest_sizes[n]
    return best, children_sizes
