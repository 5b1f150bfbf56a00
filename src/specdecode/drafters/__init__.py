"""Drafters: importing this package registers every method (one module each)."""

from . import (  # noqa: F401  (registration side effect)
    draft_model, eagle, early_exit, esp, goose, hierarchy, hydra, jacobi, layerskip, lookahead, medusa, none, pld, slem,
    slrs, streaming, suffix, tli, token_recycling, triforce,
)
from .base import DRAFTERS, Drafter, register
from .building import build_drafter

__all__ = ["DRAFTERS", "Drafter", "build_drafter", "register"]
