"""Gemma 3 (text): the Llama layout with four norms per block, per-head query/key norms, a GELU MLP, embeddings
scaled by sqrt(d), and interleaved attention kinds: sliding-window layers (local rotary base) and full layers
(global rotary base). Norm weights w act as (1 + w); the attention scale is query_pre_attn_scalar^-1/2."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .llama import Block, LlamaModel
from .ops import inverse_frequencies
from .weights import PreparedWeights

KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


class Gemma3Model(LlamaModel):
    act = "gelu"

    def __init__(self, config, weights: PreparedWeights, tokenizer, name: str, eos_ids):
        super().__init__(config, weights, tokenizer, name, eos_ids)
        rope = config.rope_parameters
        self.kinds = {
            "full": (inverse_frequencies(self.head_dim, rope["full_attention"]["rope_theta"]), None),
            "sliding": (inverse_frequencies(self.head_dim, rope["sliding_attention"]["rope_theta"]), config.sliding_window),
        }
        self.layer_kinds = [KINDS[kind] for kind in config.layer_types]
        self.heads = replace(self.heads, scale=config.query_pre_attn_scalar**-0.5)
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size), dtype=self.dtype)
        self.norm = _unit_offset(self.norm)

    def _block(self, weights: PreparedWeights, prefix: str) -> Block:
        llama = super()._block(weights, prefix)
        norm = lambda name: _unit_offset(self.param(weights, prefix + name + ".weight"))  # noqa: E731
        return Block(
            attn_norm=_unit_offset(llama.attn_norm),
            qkv=llama.qkv,
            out=llama.out,
            mlp_norm=norm("pre_feedforward_layernorm"),
            gate_up=llama.gate_up,
            down=llama.down,
            post_attn_norm=_unit_offset(llama.mlp_norm),  # Llama's post_attention_layernorm is Gemma's post-norm
            post_mlp_norm=norm("post_feedforward_layernorm"),
            q_norm=norm("self_attn.q_norm"),
            k_norm=norm("self_attn.k_norm"),
        )

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., d]
        return self.embedding[token_ids].to(self.dtype) * self.embed_scale


Model = Gemma3Model


def _unit_offset(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's norms scale by (1 + w)."""
    return (1.0 + weight.float()).to(weight.dtype)


def supports(config) -> bool:
    """Plain rotary for both kinds, GELU-tanh, no logit soft-capping: what this file implements."""
    rope = getattr(config, "rope_parameters", None) or {}
    plain = all(rope.get(kind, {}).get("rope_type", "default") == "default" for kind in KINDS)
    return (
        plain and set(KINDS) >= set(config.layer_types) and config.hidden_activation == "gelu_pytorch_tanh"
        and config.final_logit_softcapping is None and config.attn_logit_softcapping is None
        and not getattr(config, "use_bidirectional_attention", False)
    )
