"""The training objective of each head kind, on one padded batch of sequences (right padding: under the causal
mask no valid row ever sees a padded one).

- eagle (EAGLE-1): from (feature f_t + uniform noise, token x_{t+1}) predict f_{t+1}: SmoothL1 on the feature plus
  0.1 x the cross-entropy of the target's distribution lm_head(f_{t+1}) against lm_head(f_hat) (EAGLE's v_w 1.0,
  p_w 0.1).
- eagle3 (EAGLE-3): the fused features through fc, then `steps` unrolled draft steps (training-time test): step j
  feeds each row's step j-1 output with the token j places further on, at that position, attending causally over
  the first step's keys and to its own row's keys of later steps (layer.step_mask); each step's loss is the
  cross-entropy against the target's distribution restricted to the draft vocabulary, on rows whose next token
  is in it, weighted 0.8^j.
- medusa (Medusa-1): head k's cross-entropy on the token k+2 places ahead, weighted 0.8^k.
- kangaroo, eesd (exit heads): from the target's states entering the exit layer, causally over the sequence,
  predict the target's next-token distribution at every position: the cross-entropy of the target's distribution
  (its final feature through its LM head) against the head's, both over the draft vocabulary's rows of the frozen
  LM head (Kangaroo's soft-label loss; EESD's self-distillation on the target's own answers). The prompt's
  positions count too: their labels are the target's own distributions as well, twice the data for one
  extraction (accuracy is reported on the answers).

Frozen target tensors (embedding, LM head) come in `frozen`; nothing of the target is trained."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..heads.layer import EXIT_KINDS, SequenceKV, step_mask

NOISE = 0.2  # EAGLE's uniform feature noise: U(-0.1, 0.1)


def soft_cross_entropy(target_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # [..] per row
    return -(torch.softmax(target_logits.float(), -1) * torch.log_softmax(logits.float(), -1)).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def eagle_loss(head, batch: dict, frozen: dict, train: bool = True) -> tuple[torch.Tensor, dict]:
    ids, last, valid = batch["ids"], batch["last"].float(), batch["valid"]  # [B, T], [B, T, d], [B, T]
    t = ids.shape[1] - 1
    features = last[:, :-1]
    if train:
        features = features + (torch.rand_like(features) - 0.5) * NOISE
    embeds = F.embedding(ids[:, 1:], frozen["embedding"])
    positions = torch.arange(1, t + 1, device=ids.device).expand(ids.shape[0], t)
    mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()[None]
    predicted = head(embeds, features, positions, SequenceKV(), mask).float()  # [B, t, d]
    wanted = last[:, 1:]
    rows = valid[:, 1:]
    regression = masked_mean(F.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1), rows)
    with torch.no_grad():
        target_logits = wanted @ frozen["lm_head"].T  # [B, t, V]
    logits = predicted @ frozen["lm_head"].T
    token = masked_mean(soft_cross_entropy(target_logits, logits), rows)
    accuracy = masked_mean((logits.argmax(-1) == target_logits.argmax(-1)).float(), rows)
    return regression + 0.1 * token, {"acc": float(accuracy), "reg": float(regression.detach())}


def eagle3_loss(head, batch: dict, frozen: dict, steps: int, train: bool = True,
                prompt_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
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
    total = 0.0
    for step in range(steps):
        step_rows = cross_entropy[:, step * t : (step + 1) * t]  # [B, t]
        total = total + (0.8**step) * masked_mean(step_rows, weight_p[:, 2 + step : 2 + step + t])
    # accuracy of the first step (what the progress bar shows): its argmax over the draft vocabulary
    rows = ok[:, 2 : 2 + t]  # the token predicted (t+2) is in the answer and drafteable
    accuracy = masked_mean((all_logits[:, :t].argmax(-1) == target_top[:, 1:]).float(), rows)
    return total, {"acc": float(accuracy)}


def medusa_loss(head, batch: dict, frozen: dict, train: bool = True) -> tuple[torch.Tensor, dict]:
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
        loss = masked_mean(F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none"), rows)
        total = total + (0.8**k) * loss
        metrics[f"acc{k}"] = float(masked_mean((logits.argmax(-1) == labels).float(), rows))
    metrics["acc"] = metrics.get("acc0", 0.0)
    return total, metrics


def exit_loss(head, batch: dict, frozen: dict, train: bool = True) -> tuple[torch.Tensor, dict]:
    ids, last, states, valid = batch["ids"], batch["last"].float(), batch["fused"], batch["valid"]
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()[None]
    outputs = head(states, positions, SequenceKV(), mask).float()  # [B, T, d]
    draft_head = frozen["draft_lm_head"]  # [Vd, d]
    with torch.no_grad():
        target_logits = last @ draft_head.T  # [B, T, Vd]
    logits = outputs @ draft_head.T
    every = F.pad(batch["real"][:, 1:], (0, 1))  # row t predicts token t+1 (a real one)
    answers = F.pad(valid[:, 1:], (0, 1))  # ... an answer token
    loss = masked_mean(soft_cross_entropy(target_logits, logits), every)
    accuracy = masked_mean((logits.argmax(-1) == target_logits.argmax(-1)).float(), answers)
    return loss, {"acc": float(accuracy)}


def head_loss(kind: str, head, batch: dict, frozen: dict, steps: int, train: bool = True, prompt_weight: float = 0.0):
    if kind == "eagle":
        return eagle_loss(head, batch, frozen, train)
    if kind == "eagle3":
        return eagle3_loss(head, batch, frozen, steps, train, prompt_weight)
    if kind in EXIT_KINDS:
        return exit_loss(head, batch, frozen, train)
    return medusa_loss(head, batch, frozen, train)
