"""What a draft head borrows from its target: the input embedding, the final norm and the LM head (shared, never
copied), the shapes a head is built with (CausalLM.decoder_shapes), the target's hidden states over a sequence, and
a fresh head of a kind (which states it reads is the kind's: heads/kinds.py)."""

from __future__ import annotations

import torch

from ..models.base import CausalLM, HiddenStates, prefill
from .kinds import head_kind
from .layer import HeadConfig


def hidden_size(target: CausalLM) -> int:
    return int(target.embed(torch.zeros(1, dtype=torch.long)).shape[-1])


def embed(target: CausalLM, token_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., d]
    return target.embed(token_ids)


def final_norm(target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:  # [..., d], in the target's dtype
    return target.final_norm(hidden.to(target.dtype))


def lm_head(target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., V] float32
    return target.lm_head_logits(hidden.to(target.dtype))


def final_norm_weight(target: CausalLM) -> torch.Tensor:
    """[d] float32: the scale the target's final norm applies (Gemma's 1 + w included), read off the norm itself."""
    ones = torch.ones(hidden_size(target), dtype=target.dtype)
    return final_norm(target, ones).float() * (1 + target.decoder_shapes()["rms_norm_eps"]) ** 0.5


def head_config(kind: str, target: CausalLM, **overrides) -> HeadConfig:
    """A head config with the target's attention shapes (one decoder layer like the target's own)."""
    shapes = target.decoder_shapes()
    layers = head_kind(kind).feature_layers(target)
    shapes.update(vocab_size=target.vocab_size, target=target.name, feature_layers=layers)
    shapes.update(overrides)
    return HeadConfig(kind=kind, **shapes)


@torch.inference_mode()
def hidden_states(target: CausalLM, token_ids: list[int], layers: list[int]) -> torch.Tensor:
    """[K, n, H] the target's states of these layers over a sequence (one forward on a fresh cache)."""
    asked = HiddenStates(tuple(layers))
    prefill(target, target.new_cache(len(token_ids)), token_ids, asked)
    return asked.states


def new_head(kind: str, target: CausalLM, seed: int = 0, **overrides):
    """A freshly initialised head of this kind for `target` (float32), as its kind starts one (HeadKind.initialise)."""
    torch.manual_seed(seed)
    config = head_config(kind, target, **overrides)
    head = head_kind(kind).module(config)
    head_kind(kind).initialise(head, target)
    return head.float().eval()
