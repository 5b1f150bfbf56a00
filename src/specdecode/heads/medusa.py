"""Medusa-1's heads (Cai et al., 2024, arXiv 2401.10774): K small heads on the target's last feature f_t (after its
final norm); head k predicts the token k+1 places ahead (x_{t+k+1}; the target's own LM head predicts x_{t+1}).
Each head is a residual block, f + SiLU(W f + b), then the target's shared LM head (Medusa-1 initialises each head's
LM head from the target's; sharing it frozen keeps the heads small). W starts at zero: an untrained head predicts
what the target's LM head does.

Training (MedusaKind.loss): head k's cross-entropy on the token k+2 places ahead, weighted 0.8^k."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kinds import HeadKind, cross_entropy_rows, masked_mean, register_kind
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


@register_kind("medusa")
class MedusaKind(HeadKind):
    module = MedusaHeads

    def config_overrides(self, target, budget):
        return {"num_heads": budget.medusa_heads}

    def loss(self, head, batch, frozen, budget, train=True):
        ids, last, valid = batch["ids"], batch["last"].float(), batch["valid"]
        outputs = head(last)  # [B, T, K, d]
        total, metrics = 0.0, {}
        for k in range(outputs.shape[2]):
            ahead = k + 2  # head k at position t guesses the token at t + k + 2
            if ids.shape[1] <= ahead:
                break
            logits = outputs[:, : -ahead, k] @ frozen["lm_head"].T  # [B, T-ahead, V]
            labels = ids[:, ahead:]
            rows = valid[:, ahead:]
            total = total + (0.8**k) * masked_mean(cross_entropy_rows(logits, labels), rows)
            metrics[f"acc{k}"] = float(masked_mean((logits.argmax(-1) == labels).float(), rows))
        metrics["acc"] = metrics.get("acc0", 0.0)
        return total, metrics
