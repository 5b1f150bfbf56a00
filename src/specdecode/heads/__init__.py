"""Draft heads: feature-level heads (EAGLE-1, EAGLE-3, Medusa-1) and self-speculation's exit heads (Kangaroo, EESD):
the torch modules, how they are stored and found, and what they borrow from the target."""

from .eagle import EagleHead
from .eagle3 import Eagle3Head
from .exit import EESDExitLayer, KangarooAdapter
from .layer import KINDS, HeadConfig
from .medusa import MedusaHeads

HEAD_CLASSES = {"eagle": EagleHead, "eagle3": Eagle3Head, "medusa": MedusaHeads, "kangaroo": KangarooAdapter,
                "eesd": EESDExitLayer}


def build_head(config: HeadConfig):
    return HEAD_CLASSES[config.kind](config)


__all__ = ["HEAD_CLASSES", "KINDS", "EESDExitLayer", "Eagle3Head", "EagleHead", "HeadConfig", "KangarooAdapter",
           "MedusaHeads", "build_head"]
