"""The `speculators` format (vllm-project/speculators; `vllm serve DIR` loads it) and the original EAGLE layouts.

An EAGLE-3 head exports as config.json (speculators_model_type "eagle3", transformer_layer_config: a one-layer
Llama config, draft_vocab_size, norm_before_residual, eagle_aux_hidden_state_layer_ids, speculators_config with the
algorithm, a greedy proposal method and the verifier) and model.safetensors with that format's names:
fc.weight, layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight, layers.0.self_attn.*,
layers.0.mlp.*, norm.weight, lm_head.weight, d2t, t2d. The original EAGLE-3 layout names the layer `midlayer.`;
EAGLE-1's names it `layers.0.` and has fc.bias and no input norms."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import SpecDecodeError
from .layer import HeadConfig

SPECULATORS_VERSION = "0.9.0"  # the format version written (pyproject pins the package the tests validate with)


def _ours_to_layer(name: str, layer_prefix: str) -> str:
    """Our eagle3 parameter name -> the exported one (layer_prefix 'layers.0.' or 'midlayer.')."""
    if name.startswith("layer."):
        return layer_prefix + name[len("layer."):]
    if name.startswith(("input_layernorm.", "hidden_norm.")):
        return layer_prefix + name
    return name


def _layer_to_ours(name: str, layer_prefix: str) -> str | None:
    if not name.startswith(layer_prefix):
        return name
    rest = name[len(layer_prefix):]
    return rest if rest.startswith(("input_layernorm.", "hidden_norm.")) else "layer." + rest


def export_speculators(head, folder: str | Path) -> Path:
    """Write an EAGLE-3 head in the speculators format."""
    config = head.config
    if config.kind != "eagle3":
        raise SpecDecodeError(
            f"the speculators format has no {config.kind} head type that vLLM serves (speculators {SPECULATORS_VERSION}).",
            "Train an eagle3 head to export it.",
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {_ours_to_layer(k, "layers.0."): v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(speculators_config(config), indent=2))
    return folder


def speculators_config(config: HeadConfig) -> dict:
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu",
        "rope_theta": config.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": config.attention_bias, "mlp_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_id(config.target), "architectures": [config.target_architecture or "LlamaForCausalLM"]},
        },
        "torch_dtype": "float32",
    }


def verifier_id(target: str) -> str | None:
    """The target as vLLM finds it: a shipped model's hub id, else the name it was trained under."""
    from ..models.packaged import SHIPPED

    return SHIPPED[target].hub_id if target in SHIPPED else target or None


def _layer_shapes(layer: dict, **extra) -> dict:
    rope = layer.get("rope_parameters") or {}
    heads = layer["num_attention_heads"]
    shapes = dict(
        hidden_size=layer["hidden_size"], vocab_size=layer["vocab_size"], num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads, intermediate_size=layer["intermediate_size"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
        attention_bias=bool(layer.get("attention_bias", False)),
    )
    return {**shapes, **extra}


def read_speculators(raw: dict, weights: dict[str, torch.Tensor]) -> tuple[HeadConfig, dict]:
    kind = raw["speculators_model_type"]
    if kind != "eagle3":
        raise SpecDecodeError(f"speculators model type '{kind}' is not supported.", "Use an eagle3 speculator.")
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    layers = raw.get("eagle_aux_hidden_state_layer_ids") or []
    config = HeadConfig(kind="eagle3", **_layer_shapes(
        raw["transformer_layer_config"], draft_vocab_size=raw["draft_vocab_size"],
        norm_before_residual=bool(raw.get("norm_before_residual", False)), feature_layers=list(layers),
        target=verifier.get("name_or_path") or "", target_architecture=(verifier.get("architectures") or [""])[0],
    ))
    return _eagle3_state(config, weights, "layers.0.")


def read_original_eagle(raw: dict, weights: dict[str, torch.Tensor]) -> tuple[HeadConfig, dict]:
    """SafeAILab/EAGLE's layouts: EAGLE-3 (`midlayer.*`) or EAGLE-1 (`layers.0.*`, fc with bias)."""
    if not any(k.startswith(("midlayer.", "layers.0.")) for k in weights) or "fc.weight" not in weights:
        raise SpecDecodeError("the folder is neither a specdecode head, a speculators head nor an EAGLE checkpoint.",
                              "Point --draft-model at a head folder.")
    if any(k.startswith("midlayer.") for k in weights):
        d = raw["hidden_size"]
        fused = weights["fc.weight"].shape[1] // d
        config = HeadConfig(kind="eagle3", **_layer_shapes(
            raw, draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            feature_layers=list(raw.get("eagle_aux_hidden_state_layer_ids") or [-1] * fused),
        ))
        return _eagle3_state(config, weights, "midlayer.")
    config = HeadConfig(kind="eagle", **_layer_shapes(raw, attention_bias="layers.0.self_attn.q_proj.bias" in weights))
    state = {}
    for name, tensor in weights.items():
        if name.startswith("layers.0."):
            state["layer." + name[len("layers.0."):]] = tensor
        elif name.startswith("fc."):
            state[name] = tensor
    return config, state


def _eagle3_state(config: HeadConfig, weights: dict, layer_prefix: str) -> tuple[HeadConfig, dict]:
    state = {}
    for name, tensor in weights.items():
        if name.startswith(("embed_tokens.", "verifier_")):
            continue  # the target's own, shared at run time
        state[_layer_to_ours(name, layer_prefix)] = tensor
    if "d2t" not in state:  # a full-vocabulary head
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    return config, state
