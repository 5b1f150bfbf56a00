"""Hydra's heads (Ankner et al., 2024, arXiv 2402.05109): Medusa's heads made sequentially dependent. Head k reads the
target's last feature f_t (after its final norm) and the input embeddings of the tokens between t and the one it
guesses, x_{t+1} .. x_{t+k+1} (the root and the draft tokens on the path to the node being expanded), and guesses
x_{t+k+2}; Medusa's head k sees f_t alone, so every guess at depth k ignores which tokens came before it.

Each head is one residual block over that concatenation, f + SiLU(W [f, e_1, .., e_{k+1}] + b), read by the target's
shared LM head (as Medusa's heads here). W starts at zero: an untrained head predicts what the target's LM head
does at t.

Training (HydraKind.loss) is teacher-forced on the training sequence's tokens and distilled from the target (Hydra++'s
objective): head k at position t is scored by the cross-entropy of the target's own distribution for x_{t+k+2} (its
last feature at t+k+1 through the LM head) against the head's, on answer tokens, weighted 0.8^k."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kinds import HeadKind, masked_mean, register_kind, soft_cross_entropy
from .layer import HeadConfig, Linear


class HydraHeads(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.heads = nn.ModuleList(Linear((k + 2) * d, d) for k in range(config.num_heads))
        for head in self.heads:
            nn.init.zeros_(head.weight)

    def feature_input(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def forward(self, k: int, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Head k: features [.., d] and the embeddings of x_{t+1} .. x_{t+k+1}, embeds [.., k+1, d] -> [.., d]
        for the shared LM head."""
        dtype = self.heads[k].weight.dtype
        features = features.to(dtype)
        inputs = torch.cat([features, embeds.to(dtype).flatten(-2)], dim=-1)  # [.., (k+2) d]
        return features + F.silu(self.heads[k](inputs))


@register_kind("hydra")
class HydraKind(HeadKind):
    module = HydraHeads

    def config_overrides(self, target, budget):
        return {"num_heads": budget.medusa_heads}

    def loss(self, head, batch, frozen, budget, train=True):
        ids, last, valid = batch["ids"], batch["last"].float(), batch["valid"]  # [B, T], [B, T, d], [B, T]
        embeds = F.embedding(ids, frozen["embedding"])  # [B, T, d]
        total, metrics = 0.0, {}
        for k in range(head.config.num_heads):
            rows = ids.shape[1] - (k + 2)  # positions t with a token t + k + 2 to guess
            if rows <= 0:
                break
            path = torch.stack([embeds[:, 1 + j : 1 + j + rows] for j in range(k + 1)], dim=2)  # [B, rows, k+1, d]
            outputs = head(k, last[:, :rows], path).float()  # [B, rows, d]
            logits = outputs @ frozen["lm_head"].T  # [B, rows, V]
            with torch.no_grad():
                target_logits = last[:, k + 1 : k + 1 + rows] @ frozen["lm_head"].T  # the target's x_{t+k+2}
            answer = valid[:, k + 2 :]
            total = total + (0.8**k) * masked_mean(soft_cross_entropy(target_logits, logits), answer)
            hits = (logits.argmax(-1) == target_logits.argmax(-1)).float()
            metrics[f"acc{k}"] = float(masked_mean(hits, answer))
        metrics["acc"] = metrics.get("acc0", 0.0)
        return total, metrics
