"""Exit heads for self-speculation: a small trained module on top of the target's first layers, read by the target's
own (frozen) LM head.

- kangaroo (Liu et al., 2024, arXiv 2404.18911): the adapter is one attention block without an MLP: RMSNorm, multi-head
  attention (the target's shapes, its own KV cache), the residual, then its own final RMSNorm.
- eesd (Liu et al., 2024, arXiv 2406.03853): the early-exiting layer is one full decoder layer (attention and MLP),
  then its own final RMSNorm.

Both read h, the target's residual stream entering layer `exit_layer` (HiddenStates numbering; feature_layers =
[exit_layer]), at position t and predict the target's next-token distribution there: logits = norm(head(h)) @
the target's LM head rows. Those rows are the draft vocabulary (`vocab`, ascending target ids; all of them by
default; training picks the most frequent answer tokens, as EAGLE-3 does), so a target with a large vocabulary
(Gemma's 262k) does not pay its whole LM head per draft token. The rows are the target's, never stored in the head.

Zero-initialised output projections make an untrained head the target's own final norm and LM head applied at the
exit layer (the "logit lens"), the starting point training improves on.
"""

from __future__ import annotations

import torch
from torch import nn

from .layer import MLP, Attention, HeadConfig, RMSNorm


class ExitHead(nn.Module):
    """hidden [B, q, d] at positions [B, q] -> [B, q, d] normalized features for the target's LM head rows."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(config, d)
        nn.init.zeros_(self.self_attn.o_proj.weight)
        self.norm = RMSNorm(d, eps)
        self.register_buffer("vocab", torch.arange(config.draft_vocab_size))  # [Vd] target ids, ascending

    @property
    def exit_layer(self) -> int:
        return self.config.feature_layers[0]

    def forward(self, hidden, positions, kv, mask) -> torch.Tensor:
        hidden = hidden.to(self.norm.weight.dtype)
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, kv, mask)
        return self.norm(self.feed_forward(hidden))

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def target_ids(self) -> torch.Tensor:  # [Vd] the target token of each draft index
        return self.vocab

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Draft over these [Vd] target tokens (ascending)."""
        self.vocab.copy_(target_ids)


class KangarooAdapter(ExitHead):
    """Kangaroo's adapter: attention only (module docstring)."""


class EESDExitLayer(ExitHead):
    """EESD's early-exiting layer: attention, then an MLP with its own norm (module docstring)."""

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        nn.init.zeros_(self.mlp.down_proj.weight)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
