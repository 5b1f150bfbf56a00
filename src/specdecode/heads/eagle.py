"""EAGLE-1's draft head (Li et al., 2024, arXiv 2401.15077): one Llama decoder layer that, from the target's
feature f_t at position t and the embedding of the next token x_{t+1}, predicts the next feature f_{t+1}.

    f_hat = DecoderLayer(fc([embed(x_{t+1}), f_t]))     (fc: 2d -> d, with bias; no input norm, as EAGLE's layer 0)
    logits = target LM head(f_hat)

f_t is the target's last hidden state after its final norm (the last layer's output through the target's own,
shared norm), so the predicted feature goes straight into the target's shared LM head. The embedding and LM head
are the target's, never copied: the head holds only fc and the layer. Drafting deeper, a node's input feature is
its parent's f_hat.

Training (EagleKind.loss): from (feature f_t + uniform noise, token x_{t+1}) predict f_{t+1}: SmoothL1 on the
feature plus 0.1 x the cross-entropy of the target's distribution lm_head(f_{t+1}) against lm_head(f_hat) (EAGLE's
v_w 1.0, p_w 0.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kinds import HeadKind, causal_mask, masked_mean, register_kind, soft_cross_entropy
from .layer import DecoderLayer, HeadConfig, Linear, SequenceKV

NOISE = 0.2  # EAGLE's uniform feature noise: U(-0.1, 0.1)


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

    def predicted(self, outputs: torch.Tensor) -> torch.Tensor:
        """The part of the head's outputs its logits are read from (here: all of it)."""
        return outputs

    def next_feature(self, outputs: torch.Tensor) -> torch.Tensor:
        """The part of the head's outputs a child node's step reads as its feature (here: all of it)."""
        return outputs

    def feature_input(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input feature from the target's extracted one (here: as is)."""
        return features


@register_kind("eagle")
class EagleKind(HeadKind):
    module = EagleHead

    def loss(self, head, batch, frozen, budget, train=True):
        ids, last, valid = batch["ids"], batch["last"].float(), batch["valid"]  # [B, T], [B, T, d], [B, T]
        t = ids.shape[1] - 1
        features = last[:, :-1]
        if train:
            features = features + (torch.rand_like(features) - 0.5) * NOISE
        embeds = F.embedding(ids[:, 1:], frozen["embedding"])
        positions = torch.arange(1, t + 1, device=ids.device).expand(ids.shape[0], t)
        outputs = head(embeds, features, positions, SequenceKV(), causal_mask(t, ids.device)).float()  # [B, t, w]
        wanted = last[:, 1:]
        rows = valid[:, 1:]
        regressed = head.next_feature(outputs)  # [B, t, d]: what a child's step reads, aligned to f_{t+1}
        regression = masked_mean(F.smooth_l1_loss(regressed, wanted, reduction="none").mean(-1), rows)
        with torch.no_grad():
            target_logits = wanted @ frozen["lm_head"].T  # [B, t, V]
        logits = head.predicted(outputs) @ frozen["lm_head"].T
        token = masked_mean(soft_cross_entropy(target_logits, logits), rows)
        accuracy = masked_mean((logits.argmax(-1) == target_logits.argmax(-1)).float(), rows)
        return regression + 0.1 * token, {"acc": float(accuracy), "reg": float(regression.detach())}
