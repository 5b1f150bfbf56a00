"""Draft heads: feature-level heads (EAGLE-1, FSPAD, EAGLE-3, HASS, Medusa-1, Hydra) and self-speculation's exit
heads (Kangaroo, EESD): the torch modules, the kinds that say how each is fed, started and trained (kinds.py: importing this package
registers every kind, one module each), how heads are stored and found, and what they borrow from the target."""

from . import eagle, eagle3, exit, fspad, hydra, medusa  # noqa: F401  (registration side effect)
from .eagle import EagleHead
from .eagle3 import Eagle3Head
from .exit import EESDExitLayer, KangarooAdapter
from .hydra import HydraHeads
from .kinds import HEAD_KINDS, HeadKind, head_kind, register_kind
from .layer import HeadConfig
from .medusa import MedusaHeads


def build_head(config: HeadConfig):
    return head_kind(config.kind).module(config)


__all__ = ["HEAD_KINDS", "EESDExitLayer", "Eagle3Head", "EagleHead", "HeadConfig", "HeadKind", "HydraHeads",
           "KangarooAdapter", "MedusaHeads", "build_head", "head_kind", "register_kind"]
