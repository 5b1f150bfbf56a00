"""What a verifier returns, and the interface every verifier follows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams
from ..tree import Draft


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]  # draft node indices along the accepted root-to-leaf path
    accepted_tokens: list[int]  # their tokens
    bonus: int  # one token sampled from the target at the end of the path (bonus or correction)

    @property
    def new_tokens(self) -> list[int]:
        return self.accepted_tokens + [self.bonus]


class Verifier(ABC):
    @abstractmethod
    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,  # [N+1, V]: row 0 at the root, row i+1 at draft node i
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Verdict: ...


def verdict(draft: Draft, accepted: list[int], bonus: int) -> Verdict:
    return Verdict(accepted, [int(draft.tokens[i]) for i in accepted], bonus)
