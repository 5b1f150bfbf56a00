"""EAGLE drafters: a trained one-layer head drafts in the target's own feature space (heads/: EAGLE-1 `eagle`,
EAGLE-3 `eagle3`), growing EAGLE-2's dynamic tree (Li et al., 2024, arXiv 2406.16858) one head step per level.

The head's cache holds one entry per committed position t: (the target's feature at t, the token at t+1), at
position t+1. The target's features arrive for every token it verified (receive_hidden), so every entry is exact
and never rolled back; only the drafted tree levels are uncommitted and dropped after each proposal. A node's
input feature is its parent's head output (the root's children: the last committed entry's output).

`--draft-model DIR` names the head folder (ours, speculators or the original EAGLE layout); without it the head
`specdecode train KIND --model TARGET` cached for this target is used. The tree options are the draft model's
(tree_growth.py: structure eagle2 | opt | sequoia, depth, topk, budget, length, ...); under sampling the strategies
send their lossless variants (sampled chains, or deterministic trees under the verifier's point-mass rule).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import torch

from ..errors import SpecDecodeError
from ..heads import head_kind
from ..heads import target as target_side
from ..heads.layer import head_cache, quantize_head
from ..heads.store import find_head, load_head
from ..models.base import attention_mask
from ..sampling import SamplingParams
from .base import Drafter, register
from .tree_growth import TreeGrowth, TreeStrategy


@lru_cache(maxsize=8)
def _cached_head(folder: str, kind: str, dtype: torch.dtype):
    return load_head(folder, kind).to(dtype)


def resolve_head(target, kind: str, draft_model):
    """The head for `target`: a loaded head module, a folder, or (None) the one cached for the target."""
    given = isinstance(draft_model, torch.nn.Module)
    head = _given_head(kind, draft_model) if given else _folder_head(target, kind, draft_model)
    # A quantized target runs for speed: its head drafts from int8 weights too (a float32 head's bytes can cost as
    # much as the target's int4 layers), whether loaded here or handed over by the trainer (held-out tau is then
    # measured as the drafter runs). Only speed depends on the draft's numbers, never the output; training is
    # unaffected (heads.layer.Linear).
    quantize_head(head, "int8" if getattr(target, "quant", "none") != "none" else None)
    return head


def _given_head(kind: str, head: torch.nn.Module) -> torch.nn.Module:
    given = head_kind(head.config.kind)
    if not given.answers_to(kind):
        raise SpecDecodeError(f"a {head.config.kind} head cannot drive the {kind} drafter.",
                              f"Use --drafter {given.drafter}.")
    return head


def _folder_head(target, kind: str, draft_model) -> torch.nn.Module:
    folder = Path(draft_model).expanduser() if draft_model is not None else find_head(target.name, kind)
    if not folder.is_dir():
        raise SpecDecodeError(f"draft head folder {folder} does not exist.", "Pass the folder `specdecode train` wrote.")
    head = _cached_head(str(folder.resolve()), kind, target.dtype)
    if head.config.hidden_size != target_side.hidden_size(target):
        raise SpecDecodeError(
            f"the head in {folder} was made for hidden size {head.config.hidden_size}, {target.name} has "
            f"{target_side.hidden_size(target)}.", "Use the head trained for this target.",
        )
    return head


class FeatureRows:
    """The head inputs of the target's committed tokens, one row per position, as the target hands them over."""

    def __init__(self):
        self.rows: list[torch.Tensor] = []  # [n, d] chunks
        self.count = 0

    def add(self, rows: torch.Tensor) -> None:
        self.rows.append(rows)
        self.count += rows.shape[0]

    def since(self, start: int) -> torch.Tensor:  # [count - start, d]
        if len(self.rows) > 1:
            self.rows = [torch.cat(self.rows)]
        return self.rows[0][start:]


class HeadDrafter(Drafter):
    """Shared by the feature-head drafters: the head, and the head inputs of the features the target hands over
    (receive_hidden: the prompt's rows after the prefill, the root's and accepted path's after each verification)."""

    catches_up = True  # the head's cache gets rows for the tokens decoded plainly
    kind: ClassVar[str]
    takes_draft_folder = True

    def __init__(self, target, draft_model=None):
        self.target = target
        self.head = resolve_head(target, self.kind, draft_model)
        self.head_kind = head_kind(self.head.config.kind)  # this drafter's kind, or a variant trained otherwise
        layers = list(self.head.config.feature_layers)
        if not layers or min(layers) < 0:
            layers = self.head_kind.feature_layers(target)
        self.hidden_layers = tuple(layers)
        self.features: FeatureRows | None = None

    def start(self, prompt_ids, capacity):
        self.features = FeatureRows()

    @torch.inference_mode()
    def receive_hidden(self, hidden: torch.Tensor) -> None:
        """[K, n, H] target states of the n tokens that just entered its cache -> n head input rows."""
        features = self.head_kind.features(self.target, hidden)
        self.features.add(self.head.feature_input(features.to(self.head_dtype)))

    @property
    def head_dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype


class EagleDrafter(HeadDrafter):
    """A tree (tree_growth.TreeStrategy: EAGLE-2's dynamic tree by default, or OPT-Tree, Sequoia) grown by an EAGLE
    head, one head step per level."""

    kind = "eagle"
    sizes = {"depth": "depth", "budget": "nodes"}
    variants = (
        {}, {"depth": 3, "topk": 1}, {"depth": 4, "topk": 3, "budget": 10, "length": "confidence"},
        {"structure": "sequoia", "budget": 6, "depth": 4},
    )
    tune_grid = ({"depth": 4, "topk": 1}, {"depth": 6, "topk": 2, "budget": 8}, {"depth": 6, "topk": 4, "budget": 16},
                 {"structure": "opt", "budget": 12, "depth": 8})

    def __init__(self, target, draft_model=None, structure: str = "eagle2", depth: int = 5, topk: int = 3,
                 budget: int = 12, length: str = "fixed", threshold: float = 0.4, min_gain: float = 0.1,
                 accept: str = "0.7,0.1,0.04,0.02"):
        super().__init__(target, draft_model)
        self.tree = TreeStrategy(structure, depth, topk, budget, length, threshold, min_gain, accept)
        self.max_nodes = self.tree.max_nodes
        self.cache = None
        self.root_output: torch.Tensor | None = None  # [w]: the last committed entry's head output

    def start(self, prompt_ids, capacity):
        super().start(prompt_ids, capacity)
        self.cache = head_cache(self.head.config, capacity + self.tree.expanded_nodes + 1, self.head_dtype)

    @torch.inference_mode()
    def propose(self, context, params: SamplingParams, generator):
        root_logits = self.extend_entries(context)  # [V]
        draft = self.tree.grow(_HeadExpansion(self, len(context)), root_logits, params, generator, self.depth_limit)
        self.cache.discard()
        return draft

    def extend_entries(self, context: list[int]) -> torch.Tensor:
        """Add the entries (feature t, token t+1) the cache lacks, up to t = len(context) - 2; [V] logits of the
        last one's output (the root's children)."""
        start = self.cache.length
        features = self.features.since(start)  # [q, d]
        if features.shape[0]:
            tokens = torch.tensor(context[start + 1 : start + 1 + features.shape[0]])
            q = tokens.shape[0]
            positions = torch.arange(start + 1, start + 1 + q)
            causal = torch.ones(q, q, dtype=torch.bool).tril()
            outputs = self.run_head(tokens, features, positions, causal)  # [q, d]
            self.cache.commit_all()
            self.root_output = outputs[-1]
        return self.logits(self.head.predicted(self.root_output[None]))[0]

    def run_head(self, tokens, inputs, positions, tree_mask) -> torch.Tensor:
        """One head forward over q new entries (uncommitted); tree_mask [q, pending + q]; returns [q, d]."""
        q = tokens.shape[0]
        mask = attention_mask(self.cache, q, tree_mask)  # [q, end + q]
        self.cache.reserve(positions)
        embeds = target_side.embed(self.target, tokens).to(self.head_dtype)
        outputs = self.head(embeds[None], inputs[None], positions[None], self.cache, mask[None])[0]
        self.cache.advance(q)
        return outputs

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:  # [F, d] -> [F, V] over the target's vocabulary
        return target_side.lm_head(self.target, outputs)

    def commit(self, verdict, draft, target_logits) -> None:
        self.tree.update(verdict, draft)


class _HeadExpansion:
    """The expand callback of one proposal: a head step over frontier nodes, each fed its parent's head output
    (the root's children: the last committed entry's) and attending to the committed entries and its ancestors."""

    def __init__(self, drafter: EagleDrafter, context_len: int):
        self.drafter, self.context_len = drafter, context_len
        self.slot: dict[int, int] = {}  # node -> its offset among the cache's uncommitted entries
        self.outputs: list[torch.Tensor] = []  # [w] head output per uncommitted entry

    def __call__(self, tree: TreeGrowth, frontier: list[int], depth: int) -> torch.Tensor:  # [F, V]
        pending = self.drafter.cache.pending
        f = len(frontier)
        mask = torch.zeros(f, pending + f, dtype=torch.bool)  # [F, pending + F]
        parents = []
        for row, node in enumerate(frontier):
            mask[row, [self.slot[a] for a in tree.ancestors[node]]] = True
            mask[row, pending + row] = True
            self.slot[node] = pending + row
            parent = tree.parents[node]
            parents.append(self.drafter.root_output if parent < 0 else self.outputs[self.slot[parent]])
        tokens = torch.tensor([tree.tokens[n] for n in frontier])
        positions = torch.full((f,), self.context_len + depth - 1)
        head = self.drafter.head
        outputs = self.drafter.run_head(tokens, head.next_feature(torch.stack(parents)), positions, mask)  # [F, w]
        self.outputs.extend(outputs)
        return self.drafter.logits(head.predicted(outputs))


@register("eagle")
class Eagle1Drafter(EagleDrafter):
    kind = "eagle"


@register("eagle3")
class Eagle3Drafter(EagleDrafter):
    """The same tree over an EAGLE-3 head: fused low/mid/high features, its own reduced-vocabulary LM head."""

    kind = "eagle3"
    variants = ({}, {"depth": 3, "topk": 1})  # the tree code is eagle's; these cover its own head and vocabulary

    def logits(self, outputs):
        draft = self.head.draft_logits(outputs.to(self.head_dtype)).float()  # [F, Vd]
        full = torch.full((outputs.shape[0], self.target.vocab_size), float("-inf"))
        full[:, self.head.target_ids()] = draft
        return full
