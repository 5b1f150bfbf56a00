"""Drafters: importing this package registers every method (one module each)."""

from . import draft_model, esp, hierarchy, jacobi, lookahead, none, pld, token_recycling  # noqa: F401  (registration side effect)
from .base import DRAFTERS, Drafter, build_drafter, register

__all__ = ["DRAFTERS", "Drafter", "build_drafter", "register"]
