"""The head-kind registry: what the trainer, the feature extraction and the drafters need to know of a kind of draft
head, declared by the kind's own module (eagle.py, eagle3.py, medusa.py, exit.py) beside its torch module, so that
nothing else switches on a kind's name. A new head kind is one module with a HeadKind subclass decorated by
@register_kind("name") plus its import in heads/__init__.py; `specdecode train NAME`, the stored-head loader and the
drafter it names pick it up.

What a kind declares:
- its torch module (built from a HeadConfig) and the registered drafter that drafts with it;
- its features: which of the target's hidden states it reads (models.base.HiddenStates numbering) and how those
  become its input (`features`); whether training stores those layers' own states ("fused") or only the final-normed
  last feature;
- whether it drafts over its own vocabulary (set_vocabulary, target_ids);
- its start (`initialise`: an untrained head; `prepare`: before training, from the training data), the frozen target
  tensors its loss reads, and its loss on a padded batch.

The losses' shared pieces live here too: soft cross-entropy against the target's distribution, masked means."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

HEAD_KINDS: dict[str, "HeadKind"] = {}


def register_kind(name: str):
    def decorate(cls: type[HeadKind]) -> type[HeadKind]:
        cls.name = name
        cls.drafter = cls.drafter or name
        HEAD_KINDS[name] = cls()
        return cls

    return decorate


def head_kind(name: str) -> "HeadKind":
    from ..errors import SpecDecodeError

    if name not in HEAD_KINDS:
        raise SpecDecodeError(f"unknown head kind '{name}'.", f"Choose one of: {', '.join(sorted(HEAD_KINDS))}.")
    return HEAD_KINDS[name]


class HeadKind:
    name: ClassVar[str]
    module: ClassVar[type[nn.Module]]  # built as module(config)
    drafter: ClassVar[str] = ""  # the registered drafter that drafts with this head ("": the kind's name)
    # True: training stores the states of feature_layers themselves ("fused"); False: only the last layer's output
    # through the target's final norm ("last"), which every kind's loss may read as its label
    reads_layer_states: ClassVar[bool] = False
    draft_vocabulary: ClassVar[bool] = False  # True: it drafts over its own vocabulary (set_vocabulary, target_ids)

    def answers_to(self, name: str) -> bool:
        """Is `name` this kind, or the drafter that runs it (what a loader or a drafter asking for a head says)?"""
        return name in (self.name, self.drafter)

    def feature_layers(self, target, exit_layer: int = 0) -> list[int]:
        """The target's hidden states it reads, in order; n_layers = the last layer's output (then the final norm).
        `exit_layer` is the trainer's --exit-layer (0: the kind's default), for kinds that read an early layer."""
        return [target.n_layers]

    def features(self, target, hidden: torch.Tensor) -> torch.Tensor:
        """[K, n, H] the target's states of feature_layers -> [n, F] what the head's feature_input takes: by default
        the last layer's output through the target's final norm."""
        return target.final_norm(hidden[0].to(target.dtype))

    def config_overrides(self, target, budget) -> dict:
        """HeadConfig fields this kind takes from the training budget (trainer.Budget)."""
        return {}

    def initialise(self, head: nn.Module, target) -> None:
        """Make a freshly built, untrained head a sensible start (no data yet)."""

    def prepare(self, head: nn.Module, target, budget) -> None:
        """Before training: start parts of the head from the target's weights (after its vocabulary is chosen)."""

    def frozen(self, target, head: nn.Module) -> dict[str, torch.Tensor]:
        """The target tensors its loss reads, frozen: by default the embedding, final norm and whole LM head."""
        return target.frozen_weights()

    def loss(self, head: nn.Module, batch: dict, frozen: dict, budget, train: bool = True) -> tuple[torch.Tensor, dict]:
        """The training objective on one right-padded batch (ids [B, T], last [B, T, d], fused [B, T, K d] where
        stored, valid [B, T] the answer tokens, real [B, T] every token): (loss, metrics with "acc")."""
        raise NotImplementedError


def soft_cross_entropy(target_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # [..] per row
    return -(torch.softmax(target_logits.float(), -1) * torch.log_softmax(logits.float(), -1)).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def causal_mask(length: int, device) -> torch.Tensor:  # [1, T, T] bool
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]


def cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # [B, T, V], [B, T] -> [B, T]
    return F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
