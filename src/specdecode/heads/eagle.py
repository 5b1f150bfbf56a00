"""EAGLE-1's draft head (Li et al., 2024, arXiv 2401.15077): one Llama decoder layer that, from the target's
feature f_t at position t and the embedding of the next token x_{t+1}, predicts the next feature f_{t+1}.

    f_hat = DecoderLayer(fc([embed(x_{t+1}), f_t]))     (fc: 2d -> d, with bias; no input norm, as EAGLE's layer 0)
    logits = target LM head(f_hat)

f_t is the target's last hidden state after its final norm (the last layer's output through the target's own,
shared norm), so the predicted feature goes straight into the target's shared LM head. The embedding and LM head
are the target's, never copied: the head holds only fc and the layer. Drafting deeper, a node's input feature is
its parent's f_hat."""

from __future__ import annotations

import torch
from torch import nn

from .layer import DecoderLayer, HeadConfig, Linear


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = Linear(2 * d, d, bias=True)
        self.layer = DecoderLayer(config, d)

    def forward(self, embeds, features, positions, kv, mask) -> torch.Tensor:
        """embeds, features [B, q, d] at positions [B, q] -> the predicted next features [B, q, d]."""
        fused = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        return self.layer(fused, fused, positions, kv, mask)

    def feature_input(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input feature from the target's extracted one (here: as is)."""
        return features
