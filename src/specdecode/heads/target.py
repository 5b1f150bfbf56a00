"""What a draft head borrows from its target: the input embedding, the final norm and the LM head (shared, never
copied), the shapes a head is built with, and the target's hidden states.

`capture` records, during any target forward, the input of the chosen layers and the last layer's output (index
n_layers) on both backends. It is how training extracts features today, and how the drafters read the features of
the rows the target verified until the engine hands them over itself."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..errors import SpecDecodeError
from ..models.base import CausalLM
from ..models.hf import HFModel
from .layer import HeadConfig, rms_norm


def n_layers(target: CausalLM) -> int:
    return target.n_layers if isinstance(target, HFModel) else len(target.blocks)


def eagle3_layers(target: CausalLM) -> list[int]:
    """EAGLE-3's low, middle and high features: the inputs of layers 2, L//2 and L-3 (clamped for tiny models)."""
    count = n_layers(target)
    return [min(2, count - 1), count // 2, max(count - 3, 0)]


def feature_layers(kind: str, target: CausalLM) -> list[int]:
    """The hidden states a head of this kind reads; n_layers = the last layer's output (then the final norm)."""
    return eagle3_layers(target) if kind == "eagle3" else [n_layers(target)]


def hidden_size(target: CausalLM) -> int:
    return int(target.embed(torch.zeros(1, dtype=torch.long)).shape[-1])


def embed(target: CausalLM, token_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., d]
    return target.embed(token_ids)


@torch.inference_mode()
def final_norm(target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    if isinstance(target, HFModel):
        return target.model.model.norm(hidden.to(target.dtype))
    return rms_norm(hidden.to(target.dtype), target.norm, target.eps)


@torch.inference_mode()
def lm_head(target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:  # [q, d] -> [q, V] float32
    hidden = hidden.to(target.dtype)
    if isinstance(target, HFModel):
        return target.model.get_output_embeddings()(hidden).float()
    return target.lm_head(hidden).float()


def frozen_weights(target: CausalLM) -> dict[str, torch.Tensor]:
    """float32 copies of the embedding [V, d], final norm [d] and LM head [V, d], for training (autograd)."""
    if isinstance(target, HFModel):
        model = target.model
        norm = model.model.norm.weight.detach().float()
        return {
            "embedding": model.get_input_embeddings().weight.detach().float(),
            "norm": norm, "lm_head": model.get_output_embeddings().weight.detach().float(),
        }
    return {"embedding": target.embedding.float(), "norm": target.norm.float(), "lm_head": target.lm_head.dense.float()}


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
            head_dim=target.head_dim, intermediate_size=target.blocks[0].down.dense.shape[1], rms_norm_eps=target.eps,
            rope_theta=float(inv_freq[1] ** (-target.head_dim / 2)) if inv_freq.numel() > 1 else 10000.0,
            target_architecture=type(target).__name__,
        )
    shapes.update(vocab_size=target.vocab_size, target=target.name, feature_layers=feature_layers(kind, target))
    shapes.update(overrides)
    return HeadConfig(kind=kind, **shapes)


@contextmanager
def capture(target: CausalLM, layers: list[int]):
    """Within the block, every target forward appends {layer: [rows, d]} to the yielded list: the input of each
    layer in `layers` (index n_layers: the last layer's output, before the final norm)."""
    records: list[dict[int, torch.Tensor]] = []
    if isinstance(target, HFModel):
        with _capture_hf(target, layers, records):
            yield records
    elif hasattr(target, "_layer"):
        with _capture_native(target, layers, records):
            yield records
    else:
        raise SpecDecodeError(f"{target.name} does not expose its hidden states.", "Use a native or transformers model.")


@contextmanager
def _capture_native(target, layers: list[int], records: list):
    last = len(target.blocks)
    original = target._layer

    def layer_with_capture(block, layer, kv, hidden, b, *rest):
        if layer == 0:
            records.append({})
        if layer in layers:
            records[-1][layer] = hidden.detach()
        out = original(block, layer, kv, hidden, b, *rest)
        if layer == last - 1 and last in layers:
            records[-1][last] = out.detach()
        return out

    target._layer = layer_with_capture
    try:
        yield
    finally:
        del target._layer  # back to the class's method


@contextmanager
def _capture_hf(target: HFModel, layers: list[int], records: list):
    blocks = target.model.model.layers
    last = len(blocks)
    handles = []

    def before(index):
        def hook(module, args, kwargs):
            if index == 0:
                records.append({})
            if index in layers:
                hidden = args[0] if args else kwargs["hidden_states"]
                records[-1][index] = hidden.detach().reshape(-1, hidden.shape[-1])
        return hook

    def after(module, args, kwargs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        records[-1][last] = hidden.detach().reshape(-1, hidden.shape[-1])

    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(before(index), with_kwargs=True))
    if last in layers:
        handles.append(blocks[-1].register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def head_features(kind: str, target: CausalLM, record: dict[int, torch.Tensor], layers: list[int]) -> torch.Tensor:
    """[rows, d or 3d] what a head of this kind reads from one captured forward: the last feature after the final
    norm (eagle, medusa), or the fused layer inputs (eagle3)."""
    if kind == "eagle3":
        return torch.cat([record[layer] for layer in layers], dim=-1)
    return final_norm(target, record[layers[0]])


def new_head(kind: str, target: CausalLM, seed: int = 0, **overrides):
    """A freshly initialised head of this kind for `target` (float32). EAGLE-3's draft vocabulary starts as the
    first draft_vocab_size token ids; training replaces it with the most frequent ones."""
    from . import build_head

    torch.manual_seed(seed)
    head = build_head(head_config(kind, target, **overrides))
    if kind == "eagle3":
        head.set_vocabulary(torch.arange(head.config.draft_vocab_size))
    return head.float().eval()
