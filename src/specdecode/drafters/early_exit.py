"""Exit-head self-speculation: the target's first layers plus a small trained head (heads/exit.py) draft a chain.

- kangaroo (Liu et al., NeurIPS 2024, arXiv 2404.18911): the target's layers [0, l) plus a one-block attention
  adapter; the "double early exit": the draft leaves the target at layer l, and stops drafting once a token's top-1
  probability falls below `threshold` (draft_length `confidence` on each token's own probability).
- eesd (Liu et al., ACL Findings 2024, arXiv 2406.03853): the first N layers plus an early-exiting decoder layer
  trained by self-distillation (on the target's own answers and distributions); the draft length is drawn by
  Thompson sampling from a Beta posterior over the acceptance rate (draft_length `thompson`).

l (the exit layer) comes with the head: `specdecode train kangaroo|eesd --model TARGET [--exit-layer L]` trains it
and caches it for the target (or pass --draft-model DIR). The head's logits cover its draft vocabulary, through the
target's frozen LM head rows.

What the draft computes is never wasted (Kangaroo's shared-KV design): the keys and values of layers [0, l) that the
drafting wrote for the root and every draft token are exact for the target, so the draft carries their exit states
(Draft.exit_states) and the verification runs only layers [l, L) over the same cache slots. The head keeps its own
one-layer cache, one entry per committed position (the target hands those positions' exit-layer states over in
receive_hidden); the drafted entries are dropped after each proposal.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import SpecDecodeError
from ..heads.layer import head_cache
from ..models.base import Sublayers, attention_mask
from ..models.native.linear import Linear
from ..tree import Draft
from . import eagle
from .base import register
from .eagle import FeatureRows
from .self_draft import SelfDrafter
from .vocabulary import VocabularyHead


class ExitDrafter(SelfDrafter):
    kind: ClassVar[str]
    catches_up = True  # the head's cache gets rows for the tokens decoded plainly
    takes_draft_folder = True

    def __init__(self, target, draft_model, depth: int, length: str, threshold: float):
        super().__init__(target, depth, length, threshold)
        self.head = eagle.resolve_head(target, self.kind, draft_model)
        self.exit_layer = self.head.exit_layer
        if not 0 < self.exit_layer <= target.n_layers:
            raise SpecDecodeError(f"the {self.kind} head exits at layer {self.exit_layer}; {target.name} has layers "
                                  f"1..{target.n_layers}.", "Use the head trained for this target.")
        self.hidden_layers = (self.exit_layer,)  # the target hands over each committed token's exit state
        self.sublayers = Sublayers(self.exit_layer)
        self.dtype = next(self.head.parameters()).dtype
        self.vocab = self.head.vocab  # [Vd] target ids
        self.draft_head = draft_vocabulary_head(target, self.vocab, self.dtype)
        self.features: FeatureRows | None = None
        self.head_cache = None
        self.states: list[torch.Tensor] = []  # [1, d] exit states of this proposal's root and draft tokens

    def start(self, prompt_ids, capacity):
        self.features = FeatureRows()
        self.head_cache = head_cache(self.head.config, capacity + self.max_nodes + 2, self.dtype)

    def receive_hidden(self, hidden: torch.Tensor) -> None:
        self.features.add(hidden[0].to(self.dtype))  # [n, d] exit states, one per position

    def begin(self, context):
        """Head entries for the committed positions it lacks (those the target verified since the last proposal)."""
        start = self.head_cache.length
        states = self.features.since(start)  # [q, d]
        if states.shape[0]:
            causal = torch.ones(states.shape[0], states.shape[0], dtype=torch.bool).tril()
            self.run_head(states, torch.arange(start, start + states.shape[0]), causal)
            self.head_cache.commit_all()
        self.states = []

    def next_logits(self, token, position):
        state = self.run_target(token, position, self.sublayers)  # [1, d]: entering the exit layer
        self.states.append(state)
        see_all = torch.ones(1, self.head_cache.pending + 1, dtype=torch.bool)
        output = self.run_head(state, torch.tensor([position]), see_all)  # [1, d]
        return self.draft_head(output)[0].float()

    def run_head(self, states, positions, tree_mask) -> torch.Tensor:
        """One head forward over q exit states [q, d] at `positions` (entries stay uncommitted); [q, d] features."""
        q = states.shape[0]
        mask = attention_mask(self.head_cache, q, tree_mask)  # [q, end + q]
        self.head_cache.reserve(positions)
        output = self.head(states[None], positions[None], self.head_cache, mask[None])[0]
        self.head_cache.advance(q)
        return output

    def finish(self, tokens, draft_probs, root):
        self.states.append(self.run_target(tokens[-1], root + len(tokens), self.sublayers))  # the last token's
        self.head_cache.discard()
        states = torch.cat(self.states)  # [N+1, d]
        return Draft(torch.tensor(tokens), torch.arange(len(tokens)) - 1, draft_probs, None, states, self.exit_layer)


def draft_vocabulary_head(target, vocab: torch.Tensor, dtype: torch.dtype) -> VocabularyHead:
    """The target's frozen LM head rows of the draft vocabulary: sliced from a native quantized head (read at its
    quantized size, not as a dense float copy: the rows are most of what a draft token reads), else dense rows."""
    if isinstance(getattr(target, "lm_head", None), Linear) and target.lm_head.packed is not None:
        return VocabularyHead.of(target.lm_head, vocab, target.vocab_size)
    return VocabularyHead(target.lm_head_rows(vocab).to(dtype), vocab, target.vocab_size)


@register("kangaroo")
class KangarooDrafter(ExitDrafter):
    kind = "kangaroo"
    variants = ({}, {"depth": 3, "threshold": 0.0, "lookup": 2, "lookup_nodes": 4})
    tune_grid = ({"threshold": 0.4}, {"threshold": 0.8}, {"depth": 4}, {"depth": 8, "threshold": 0.4})

    def __init__(self, target, draft_model=None, depth: int = 6, threshold: float = 0.6, length: str = "confidence"):
        super().__init__(target, draft_model, depth, length, threshold)


@register("eesd")
class EESDDrafter(ExitDrafter):
    kind = "eesd"
    variants = ({},)  # the chain and head code is kangaroo's; this covers its head and the Thompson length
    tune_grid = ({"depth": 4}, {"depth": 10}, {"length": "confidence", "threshold": 0.4})

    def __init__(self, target, draft_model=None, depth: int = 6, length: str = "thompson", threshold: float = 0.4):
        super().__init__(target, draft_model, depth, length, threshold)
