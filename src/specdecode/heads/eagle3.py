"""EAGLE-3's draft head (Li et al., 2025, arXiv 2503.01840): the target's low, middle and high features (the
inputs of three of its layers) fused by fc (3d -> d), one decoder layer whose attention reads
[input_layernorm(embed(x_{t+1})), hidden_norm(h_t)] (2d), its own final norm and an LM head over a reduced draft
vocabulary: draft index i is target token i + d2t[i]; t2d marks the target tokens in the draft vocabulary.

Drafting deeper, a node's input h is its parent's output (already d wide, so fc is skipped), as in training-time
test. The layer's residual is h (or hidden_norm(h) with norm_before_residual, speculators' flag).

Training (Eagle3Kind.loss): the fused features through fc, then `ttt_steps` unrolled draft steps (training-time
test): step j feeds each row's step j-1 output with the token j places further on, at that position, attending
causally over the first step's keys and to its own row's keys of later steps (layer.step_mask); each step's loss is
the cross-entropy against the target's distribution restricted to the draft vocabulary, on rows whose next token is
in it, weighted 0.8^j."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kinds import HeadKind, masked_mean, register_kind, soft_cross_entropy
from .layer import DecoderLayer, HeadConfig, Linear, RMSNorm, SequenceKV, step_mask


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

    def predicted(self, outputs: torch.Tensor) -> torch.Tensor:
        """The part of the head's outputs its logits are read from (here: all of it)."""
        return outputs

    def next_feature(self, outputs: torch.Tensor) -> torch.Tensor:
        """The part of the head's outputs a child node's step reads as its feature (here: all of it)."""
        return outputs

    def feature_input(self, fused: torch.Tensor) -> torch.Tensor:
        """[.., 3d] concatenated target features -> [.., d]."""
        return self.fc(fused.to(self.fc.weight.dtype))

    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:  # [.., Vd]
        return self.lm_head(self.norm(outputs))

    def target_ids(self) -> torch.Tensor:  # [Vd] the target token of each draft index
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def start_from(self, layer: dict[str, torch.Tensor]) -> None:
        """Start the decoder layer from a target layer's weights (CausalLM.last_layer_weights): the hidden half of q,
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


def eagle3_layers(target) -> list[int]:
    """EAGLE-3's low, middle and high features: the inputs of layers 2, L//2 and L-3 (clamped for tiny models)."""
    count = target.n_layers
    return [min(2, count - 1), count // 2, max(count - 3, 0)]


@register_kind("eagle3")
class Eagle3Kind(HeadKind):
    module = Eagle3Head
    reads_layer_states = True
    draft_vocabulary = True

    def feature_layers(self, target, exit_layer=0):
        return eagle3_layers(target)

    def config_overrides(self, target, budget):
        return {"ttt_steps": budget.ttt_steps}

    def features(self, target, hidden):  # [K, n, H] -> [n, K H]: the K layer inputs side by side
        return hidden.permute(1, 0, 2).reshape(hidden.shape[1], -1)

    def initialise(self, head, target):
        head.set_vocabulary(torch.arange(head.config.draft_vocab_size))  # training picks the most frequent tokens

    def prepare(self, head, target, budget):
        frozen = target.frozen_weights()
        with torch.no_grad():  # start from the target's own LM head rows and final norm
            head.lm_head.weight.copy_(frozen["lm_head"][head.target_ids()])
            head.norm.weight.copy_(frozen["norm"])
        layer = target.last_layer_weights() if budget.warm_start else None
        if layer is not None:
            head.start_from(layer)

    def frozen(self, target, head):
        frozen = target.frozen_weights()
        frozen["draft_lm_head"] = frozen["lm_head"][head.target_ids()]
        return frozen

    def loss(self, head, batch, frozen, budget, train=True):
        return eagle3_loss(head, batch, frozen, budget.ttt_steps, budget.prompt_weight)


def eagle3_loss(head, batch: dict, frozen: dict, steps: int, prompt_weight: float = 0.0,
                top_k: int = 0, top_k_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """EAGLE-3's training-time-test loss (module docstring); with top_k, each step adds top_k_weight x HASS's
    harmonized objective distillation: the cross-entropy restricted to the target's top_k tokens."""
    ids, last, fused, valid = batch["ids"], batch["last"].float(), batch["fused"], batch["valid"]
    b, t = ids.shape[0], ids.shape[1] - 1  # rows: t = 0..T-2, one per (feature t, token t+1)
    draft_head = frozen["draft_lm_head"]  # [Vd, d]
    pad = steps  # tokens, targets and masks padded so every step reads `t` rows
    with torch.no_grad():
        target_logits = last @ draft_head.T  # [B, T, Vd]: the target's distribution over the draft vocabulary
        target_top = target_logits.argmax(-1)  # [B, T] the target's greedy token
    in_vocab = head.t2d[ids]  # [B, T]: the next token is drafteable
    ids_p = F.pad(ids, (0, pad))
    target_p = F.pad(target_logits, (0, 0, 0, pad))
    prompt = batch["real"] & ~valid  # [B, T] the prompt's tokens
    weight = (valid.float() + prompt_weight * prompt.float()) * in_vocab  # [B, T] of the token a row predicts
    weight_p = F.pad(weight, (0, pad))
    ok = F.pad(valid & in_vocab, (0, pad))
    hidden = head.feature_input(fused[:, :-1])  # [B, t, d]
    kv = SequenceKV()
    outputs = []  # each step's head output [B, t, d]
    for step in range(steps):
        embeds = F.embedding(ids_p[:, 1 + step : 1 + step + t], frozen["embedding"])  # token t+1+j
        positions = torch.arange(1 + step, 1 + step + t, device=ids.device).expand(b, t)
        hidden = head(embeds, hidden, positions, kv, step_mask(t, step).to(ids.device)[None])  # [B, t, d]
        outputs.append(hidden)
    # One LM-head product over every step's rows: the draft vocabulary's weight is read, cast and given its
    # gradient once, not once per step (the logits feed only the loss, never the next step)
    all_logits = head.draft_logits(torch.cat(outputs, dim=1))  # [B, steps * t, Vd]
    wanted = torch.cat([target_p[:, 1 + step : 1 + step + t] for step in range(steps)], dim=1)  # position t+1+j
    cross_entropy = soft_cross_entropy(wanted, all_logits)  # [B, steps * t]
    if top_k:
        cross_entropy = cross_entropy + top_k_weight * top_k_cross_entropy(wanted, all_logits, top_k)
    total = 0.0
    for step in range(steps):
        step_rows = cross_entropy[:, step * t : (step + 1) * t]  # [B, t]
        total = total + (0.8**step) * masked_mean(step_rows, weight_p[:, 2 + step : 2 + step + t])
    # accuracy of the first step (what the progress bar shows): its argmax over the draft vocabulary
    rows = ok[:, 2 : 2 + t]  # the token predicted (t+2) is in the answer and drafteable
    accuracy = masked_mean((all_logits[:, :t].argmax(-1) == target_top[:, 1:]).float(), rows)
    return total, {"acc": float(accuracy)}


def top_k_cross_entropy(target_logits: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:  # [..] per row
    """-sum over the target's k most likely tokens x of p(x) log q(x): the part of the distillation that decides
    which tokens the draft ranks first, where acceptance is decided (HASS)."""
    target_probs, top = torch.softmax(target_logits.float(), -1).topk(min(k, target_logits.shape[-1]), dim=-1)
    return -(target_probs * torch.log_softmax(logits.float(), -1).gather(-1, top)).sum(-1)


@register_kind("hass")
class HASSKind(Eagle3Kind):
    """HASS (Zhang et al., ICLR 2025, arXiv 2408.15766) on the EAGLE-3 head: harmonized context alignment (training
    on the head's own earlier outputs, as it drafts: EAGLE-3's training-time test, `ttt_steps` deep) and harmonized
    objective distillation (the cross-entropy over the target's top-K tokens added to the full one, K = 10,
    weight 1, HASS's defaults). Same head, same drafter: only the objective differs."""

    drafter = "eagle3"
    top_k, top_k_weight = 10, 1.0

    def loss(self, head, batch, frozen, budget, train=True):
        return eagle3_loss(head, batch, frozen, budget.ttt_steps, budget.prompt_weight, self.top_k, self.top_k_weight)
