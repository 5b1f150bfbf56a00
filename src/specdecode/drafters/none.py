"""Plain decoding through the same engine: an empty draft, so each target forward yields one token."""

from __future__ import annotations

from ..tree import Draft
from .base import Drafter, register


@register("none")
class NoDrafter(Drafter):
    def __init__(self, target):
        self.max_nodes = 0

    def propose(self, context, params, generator) -> Draft:
        return Draft.empty()
