"""EAGLE-3's draft head (Li et al., 2025, arXiv 2503.01840): the target's low, middle and high features (the
inputs of three of its layers) fused by fc (3d -> d), one decoder layer whose attention reads
[input_layernorm(embed(x_{t+1})), hidden_norm(h_t)] (2d), its own final norm and an LM head over a reduced draft
vocabulary: draft index i is target token i + d2t[i]; t2d marks the target tokens in the draft vocabulary.

Drafting deeper, a node's input h is its parent's output (already d wide, so fc is skipped), as in training-time
test. The layer's residual is h (or hidden_norm(h) with norm_before_residual, speculators' flag)."""

from __future__ import annotations

import torch
from torch import nn

from .layer import DecoderLayer, HeadConfig, Linear, RMSNorm


class Eagle3Head(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        d, eps = config.hidden_size, config.rms_norm_eps
        self.fc = Linear(len(config.feature_layers) * d, d, bias=False)
        self.input_layernorm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.layer = DecoderLayer(config, 2 * d)
        self.norm = RMSNorm(d, eps)
        self.lm_head = Linear(d, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # [Vd] offsets
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))  # [V]

    def forward(self, embeds, hidden, positions, kv, mask) -> torch.Tensor:
        """embeds [B, q, d]; hidden [B, q, d] (the fused target features after feature_input, or a parent's
        output) at positions [B, q] -> outputs [B, q, d]."""
        hidden = hidden.to(embeds.dtype)
        normed = self.hidden_norm(hidden)
        attn_input = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, q, 2d]
        residual = normed if self.config.norm_before_residual else hidden
        return self.layer(attn_input, residual, positions, kv, mask)

    def feature_input(self, fused: torch.Tensor) -> torch.Tensor:
        """[.., 3d] concatenated target features -> [.., d]."""
        return self.fc(fused.to(self.fc.weight.dtype))

    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:  # [.., Vd]
        return self.lm_head(self.norm(outputs))

    def target_ids(self) -> torch.Tensor:  # [Vd] the target token of each draft index
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def start_from(self, layer: dict[str, torch.Tensor]) -> None:
        """Start the decoder layer from a target layer's weights (heads.target.last_layer): the hidden half of q,
        k and v takes the target's projections and hidden_norm its input norm (attention reads [embedding, hidden]);
        o, the biases, the post-attention norm and the MLP (where as wide) are copied; fc and the embedding half stay
        random. A one-layer head trained on little data generalises better from a trained block than from noise
        (the EAGLE-3 training report)."""
        d = self.config.hidden_size
        self.hidden_norm.weight.copy_(layer["input_layernorm.weight"])
        own = self.layer.state_dict()
        for name, weight in layer.items():
            if name not in own or (name.startswith("mlp.") and own[name].shape != weight.shape):
                continue  # the input norm (above); a narrower MLP (--intermediate-size) keeps its random start
            if name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
                own[name][:, d:] = weight
            else:
                own[name].copy_(weight)

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Use these [Vd] target tokens (ascending) as the draft vocabulary."""
        self.d2t.copy_(target_ids - torch.arange(target_ids.shape[0]))
        self.t2d.zero_()
        self.t2d[target_ids] = True
