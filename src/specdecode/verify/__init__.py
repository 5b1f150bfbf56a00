"""Verifiers: greedy (exact match), rejection sampling (chain, sampled trees, deterministic trees) and block
verification (sampled chains)."""

from ..sampling import SamplingParams
from .base import Verdict, Verifier
from .block import BlockVerifier
from .greedy import GreedyVerifier
from .rejection import RejectionVerifier


def verifier_for(params: SamplingParams) -> Verifier:
    if params.greedy:
        return GreedyVerifier()
    return BlockVerifier() if params.verification == "block" else RejectionVerifier()


__all__ = ["Verdict", "Verifier", "GreedyVerifier", "RejectionVerifier", "BlockVerifier", "verifier_for"]
