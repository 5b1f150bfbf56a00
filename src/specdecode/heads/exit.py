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

Training (ExitKind.loss): from the target's states entering the exit layer, causally over the sequence, predict the
target's next-token distribution at every position: the cross-entropy of the target's distribution (its final
feature through its LM head) against the head's, both over the draft vocabulary's rows of the frozen LM head
(Kangaroo's soft-label loss; EESD's self-distillation on the target's own answers). The prompt's positions count
too: their labels are the target's own distributions as well, twice the data for one extraction (accuracy is
reported on the answers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kinds import HeadKind, causal_mask, masked_mean, register_kind, soft_cross_entropy
from .layer import MLP, Attention, HeadConfig, RMSNorm, SequenceKV
from .target import final_norm_weight


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


def default_exit_layer(n_layers: int) -> int:
    """Where an exit head reads the target by default: after the first sixth of its layers, at least one. Kangaroo
    exits after 2 of Vicuna-7B's 32 layers; small targets need a larger share of their depth to draft well, and the
    draft still costs a fraction of a forward."""
    return min(n_layers, max(1, n_layers // 6))


class ExitKind(HeadKind):
    """An exit head's kind: it reads the input of its exit layer and drafts over its own vocabulary."""

    reads_layer_states = True
    draft_vocabulary = True

    def feature_layers(self, target, exit_layer=0):
        return [exit_layer or default_exit_layer(target.n_layers)]

    def config_overrides(self, target, budget):
        return {"feature_layers": self.feature_layers(target, budget.exit_layer)}

    def initialise(self, head, target):
        with torch.no_grad():  # start as the target's own final norm at the exit layer
            head.norm.weight.copy_(final_norm_weight(target))

    def frozen(self, target, head):  # only the draft vocabulary's LM head rows
        return {"draft_lm_head": target.lm_head_rows(head.target_ids())}

    def loss(self, head, batch, frozen, budget, train=True):
        ids, last, states, valid = batch["ids"], batch["last"].float(), batch["fused"], batch["valid"]
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device).expand(b, t)
        outputs = head(states, positions, SequenceKV(), causal_mask(t, ids.device)).float()  # [B, T, d]
        draft_head = frozen["draft_lm_head"]  # [Vd, d]
        with torch.no_grad():
            target_logits = last @ draft_head.T  # [B, T, Vd]
        logits = outputs @ draft_head.T
        every = F.pad(batch["real"][:, 1:], (0, 1))  # row t predicts token t+1 (a real one)
        answers = F.pad(valid[:, 1:], (0, 1))  # ... an answer token
        loss = masked_mean(soft_cross_entropy(target_logits, logits), every)
        accuracy = masked_mean((logits.argmax(-1) == target_logits.argmax(-1)).float(), answers)
        return loss, {"acc": float(accuracy)}


@register_kind("kangaroo")
class KangarooKind(ExitKind):
    module = KangarooAdapter


@register_kind("eesd")
class EESDKind(ExitKind):
    module = EESDExitLayer
