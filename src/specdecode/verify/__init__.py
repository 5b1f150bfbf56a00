"""Verifiers: greedy (exact match) and rejection sampling (chain, sampled trees, deterministic trees)."""

from ..sampling import SamplingParams
from .base import Verdict, Verifier
from .greedy import GreedyVerifier
from .rejection import RejectionVerifier


def verifier_for(params: SamplingParams) -> Verifier:
    return GreedyVerifier() if params.greedy else RejectionVerifier()


__all__ = ["Verdict", "Verifier", "GreedyVerifier", "RejectionVerifier", "verifier_for"]
