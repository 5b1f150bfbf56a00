"""Sampling parameters and the one function that turns logits into the distribution we sample from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SpecDecodeError


VERIFICATIONS = ("block", "token")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    # How a sampled chain is verified: "block" (block verification: the whole chain judged jointly, never fewer
    # tokens accepted) or "token" (token by token). Both keep the target's distribution; trees use the token rule.
    verification: str = "block"

    def __post_init__(self):
        if not self.temperature >= 0:  # also rejects NaN
            raise SpecDecodeError(f"temperature must be >= 0, got {self.temperature}.", "Use 0 for greedy decoding.")
        if self.top_k < 0:
            raise SpecDecodeError(f"top-k must be >= 0, got {self.top_k}.", "Use 0 to disable top-k.")
        if not 0 < self.top_p <= 1:
            raise SpecDecodeError(f"top-p must be in (0, 1], got {self.top_p}.", "Use 1 to disable top-p.")
        if self.verification not in VERIFICATIONS:
            raise SpecDecodeError(f"unknown verification '{self.verification}'.",
                                  f"Use one of: {', '.join(VERIFICATIONS)}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p (in that order)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
