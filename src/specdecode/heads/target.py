"""What a draft head borrows from its target: the input embedding, the final norm and the LM head (shared, never
copied), the shapes a head is built with, and which of the target's hidden states it reads (models.base.HiddenStates
numbering: layer i's input; n_layers = the last layer's output before the final norm)."""

from __future__ import annotations

import torch

from ..models.base import CausalLM, HiddenStates, prefill
from ..models.hf import HFModel
from .layer import EXIT_KINDS, HeadConfig


def eagle3_layers(target: CausalLM) -> list[int]:
    """EAGLE-3's low, middle and high features: the inputs of layers 2, L//2 and L-3 (clamped for tiny models)."""
    count = target.n_layers
    return [min(2, count - 1), count // 2, max(count - 3, 0)]


def default_exit_layer(n_layers: int) -> int:
    """Where an exit head (Kangaroo, EESD) reads the target by default: after the first sixth of its layers, at
    least one. Kangaroo exits after 2 of Vicuna-7B's 32 layers; small targets need a larger share of their depth to
    draft well, and the draft still costs a fraction of a forward."""
    return min(n_layers, max(1, n_layers // 6))


def feature_layers(kind: str, target: CausalLM, exit_layer: int = 0) -> list[int]:
    """The hidden states a head of this kind reads; n_layers = the last layer's output (then the final norm). Exit
    heads read the input of their exit layer (0: default_exit_layer)."""
    if kind in EXIT_KINDS:
        return [exit_layer or default_exit_layer(target.n_layers)]
    return eagle3_layers(target) if kind == "eagle3" else [target.n_layers]


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
    return final_norm(target, ones).float() * (1 + _norm_eps(target)) ** 0.5


def _norm_eps(target: CausalLM) -> float:
    if isinstance(target, HFModel):
        return float(target.model.config.get_text_config(decoder=True).rms_norm_eps)
    return float(target.eps)


@torch.no_grad()  # not inference_mode: training multiplies by these rows under autograd
def lm_head_rows(target: CausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """[n, d] float32: the target's LM head rows of these tokens (a draft vocabulary), without materialising the
    whole head in float32 (Gemma's has 262k rows)."""
    if isinstance(target, HFModel):
        return target.model.get_output_embeddings().weight[token_ids].float()
    head = target.lm_head
    if head.dense is not None:
        return head.dense[token_ids].float()
    from ..models.native.linear import TILE, dequantize

    tiles = torch.unique(token_ids // TILE)  # [t]: the packed tiles holding these rows
    rows = dequantize(head.packed[tiles], head.quant)  # [t * TILE, d]
    where = torch.searchsorted(tiles, token_ids // TILE) * TILE + token_ids % TILE
    return rows[where]


def frozen_weights(target: CausalLM) -> dict[str, torch.Tensor]:
    """float32 copies of the embedding [V, d], final norm [d] and LM head [V, d], for training (autograd)."""
    if isinstance(target, HFModel):
        model = target.model
        norm = model.model.norm.weight.detach().float()
        return {
            "embedding": model.get_input_embeddings().weight.detach().float(),
            "norm": norm, "lm_head": model.get_output_embeddings().weight.detach().float(),
        }
    return {"embedding": target.embedding.float(), "norm": target.norm.float(), "lm_head": target.lm_head.weight()}


LLAMA_LAYERS = ("llama", "qwen2", "mistral")  # transformers model types whose decoder layer is a Llama block


@torch.no_grad()
def last_layer(target: CausalLM) -> dict[str, torch.Tensor] | None:
    """float32 copies of the target's last decoder layer, named as a head's DecoderLayer names them
    (self_attn.{q,k,v,o}_proj.weight, q/k/v biases if any, mlp.{gate,up,down}_proj.weight,
    post_attention_layernorm.weight) plus its input_layernorm.weight; None where that layer is not a Llama block
    (Gemma's extra norms, 1 + w norm weights and GELU)."""
    if isinstance(target, HFModel):
        if target.model.config.get_text_config(decoder=True).model_type not in LLAMA_LAYERS:
            return None
        return {k: v.float().clone() for k, v in target.model.get_decoder().layers[-1].state_dict().items()}
    block = target.blocks[-1]
    if getattr(target, "act", None) != "silu" or block.post_attn_norm is not None or block.q_norm is not None:
        return None
    sizes = [target.n_heads * target.head_dim] + [target.n_kv_heads * target.head_dim] * 2
    layer = {"input_layernorm.weight": block.attn_norm.float(), "post_attention_layernorm.weight": block.mlp_norm.float(),
             "self_attn.o_proj.weight": block.out.weight(), "mlp.down_proj.weight": block.down.weight()}
    for name, weight in zip("qkv", block.qkv.weight().split(sizes)):
        layer[f"self_attn.{name}_proj.weight"] = weight
    if block.qkv.bias is not None:
        for name, bias in zip("qkv", block.qkv.bias.float().split(sizes)):
            layer[f"self_attn.{name}_proj.bias"] = bias
    gate, up = block.gate_up.weight().chunk(2)
    layer.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
    return layer


def head_config(kind: str, target: CausalLM, **overrides) -> HeadConfig:
    """A head config with the target's attention shapes (one decoder layer like the target's own)."""
    if isinstance(target, HFModel):
        c = target.model.config.get_text_config(decoder=True)
        rope = getattr(c, "rope_parameters", None) or {}
        shapes = dict(
            hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads or c.num_attention_heads, head_dim=target.head_dim,
            intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            target_architecture=(target.model.config.architectures or [type(target.model).__name__])[0],
        )
    else:
        inv_freq = next(iter(target.kinds.values()))[0]
        d = target.embedding.shape[1]
        shapes = dict(
            hidden_size=d, num_attention_heads=target.n_heads, num_key_value_heads=target.n_kv_heads,
            head_dim=target.head_dim, intermediate_size=target.blocks[0].down.in_features, rms_norm_eps=target.eps,
            rope_theta=float(inv_freq[1] ** (-target.head_dim / 2)) if inv_freq.numel() > 1 else 10000.0,
            target_architecture=type(target).__name__,
        )
    shapes.update(vocab_size=target.vocab_size, target=target.name, feature_layers=feature_layers(kind, target))
    shapes.update(overrides)
    return HeadConfig(kind=kind, **shapes)


def head_features(kind: str, target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """[n, d or K d]: what a head of this kind reads of the target's [K, n, H] hidden states (its feature_layers,
    in order): the last layer's output through the target's final norm (eagle, medusa), or the K layer inputs
    side by side (eagle3)."""
    if kind == "eagle3":
        return hidden.permute(1, 0, 2).reshape(hidden.shape[1], -1)
    return final_norm(target, hidden[0])


@torch.inference_mode()
def hidden_states(target: CausalLM, token_ids: list[int], layers: list[int]) -> torch.Tensor:
    """[K, n, H] the target's states of these layers over a sequence (one forward on a fresh cache)."""
    asked = HiddenStates(tuple(layers))
    prefill(target, target.new_cache(len(token_ids)), token_ids, asked)
    return asked.states


def new_head(kind: str, target: CausalLM, seed: int = 0, **overrides):
    """A freshly initialised head of this kind for `target` (float32). EAGLE-3's draft vocabulary starts as the
    first draft_vocab_size token ids; training replaces it with the most frequent ones."""
    from . import build_head

    torch.manual_seed(seed)
    head = build_head(head_config(kind, target, **overrides))
    if kind == "eagle3":
        head.set_vocabulary(torch.arange(head.config.draft_vocab_size))
    if kind in EXIT_KINDS:  # start as the target's own final norm at the exit layer
        with torch.no_grad():
            head.norm.weight.copy_(final_norm_weight(target))
    return head.float().eval()
