"""FSPAD (Gui et al., 2024, arXiv 2408.15562): the EAGLE-1 head with feature sampling and partial alignment
distillation.

- Feature sampling: after fc ([embed(x_{t+1}), f_t] -> d), h = h + EMLP(norm(h), embed(x_{t+1})), a gated MLP whose
  gate reads the token's embedding, down(SiLU(gate(e)) * up(norm(h))): the token "samples" the uncertain feature
  toward itself before the decoder layer.
- Partial alignment: the decoder layer's MLP writes 2d, over the residual [h, h]; the first half is read by the
  target's shared LM head (the prediction), the second is regressed onto the target's next feature and is what a
  child node's step reads. The two objectives no longer pull one vector two ways.

Training (FSPADKind.loss) is EAGLE-1's on those halves: SmoothL1 of the second half against f_{t+1} plus 0.1 x the
cross-entropy of the target's distribution against the LM head over the first half, noise on the input feature.
Drafting is EAGLE-1's drafter unchanged (it reads heads through predicted/next_feature)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .eagle import EagleKind
from .kinds import register_kind
from .layer import Attention, HeadConfig, Linear, RMSNorm


class FSPADHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        d, i, eps = config.hidden_size, config.intermediate_size, config.rms_norm_eps
        self.fc = Linear(2 * d, d, bias=True)
        self.sample_norm = RMSNorm(d, eps)
        self.sample_gate = Linear(d, i, bias=False)  # reads the token embedding
        self.sample_up = Linear(d, i, bias=False)
        self.sample_down = Linear(i, d, bias=False)
        nn.init.zeros_(self.sample_down.weight)  # starts as EAGLE-1's fc alone
        self.self_attn = Attention(config, d)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.gate_proj = Linear(d, i, bias=False)
        self.up_proj = Linear(d, i, bias=False)
        self.down_proj = Linear(i, 2 * d, bias=False)  # [prediction, next feature]

    def forward(self, embeds, features, positions, kv, mask) -> torch.Tensor:
        """embeds, features [B, q, d] at positions [B, q] -> [B, q, 2d]: the prediction, then the next feature."""
        features = features.to(embeds.dtype)
        h = self.fc(torch.cat([embeds, features], dim=-1))
        h = h + self.sample_down(F.silu(self.sample_gate(embeds)) * self.sample_up(self.sample_norm(h)))
        h = h + self.self_attn(h, positions, kv, mask)
        normed = self.post_attention_layernorm(h)
        return torch.cat([h, h], dim=-1) + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def predicted(self, outputs: torch.Tensor) -> torch.Tensor:  # [.., 2d] -> [.., d] for the LM head
        return outputs[..., : self.config.hidden_size]

    def next_feature(self, outputs: torch.Tensor) -> torch.Tensor:  # [.., 2d] -> [.., d] for the child's step
        return outputs[..., self.config.hidden_size :]

    def feature_input(self, features: torch.Tensor) -> torch.Tensor:
        return features


@register_kind("fspad")
class FSPADKind(EagleKind):
    module = FSPADHead
    drafter = "eagle"
