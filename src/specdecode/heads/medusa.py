"""Medusa-1's heads (Cai et al., 2024, arXiv 2401.10774): K small heads on the target's last feature f_t (after its
final norm); head k predicts the token k+1 places ahead (x_{t+k+1}; the target's own LM head predicts x_{t+1}).
Each head is a residual block, f + SiLU(W f + b), then the target's shared LM head (Medusa-1 initialises each head's
LM head from the target's; sharing it frozen keeps the heads small). W starts at zero: an untrained head predicts
what the target's LM head does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layer import HeadConfig, Linear


class ResBlock(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.linear = Linear(size, size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.num_heads))

    def feature_input(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[.., d] target features -> [.., K, d]: what each head hands to the shared LM head."""
        features = features.to(self.heads[0].linear.weight.dtype)
        return torch.stack([head(features) for head in self.heads], dim=-2)
