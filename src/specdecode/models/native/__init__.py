"""The native CPU backend: our own small model file per family over the engine's KVCache, with bfloat16, int8 or
int4 weights. A family is one module with a CausalLM class and `supports(config)`, plus one line in FAMILIES."""

from __future__ import annotations

from pathlib import Path

from . import gemma3, llama
from ..base import eos_token_ids
from .linear import QUANTS
from .weights import PreparedWeights, SafetensorsWeights, cache_file_for

FAMILIES = {"llama": llama, "qwen2": llama, "gemma3_text": gemma3}  # config.model_type -> module


def supported(config) -> bool:
    family = FAMILIES.get(getattr(config, "model_type", None))
    return family is not None and family.supports(config)


def build(config, weights: PreparedWeights, tokenizer, name: str, eos_ids):
    model = FAMILIES[config.model_type].Model(config, weights, tokenizer, name, eos_ids)
    weights.save()
    return model


def from_transformers(model, tokenizer, name: str, quant: str = "none"):
    """The native twin of a loaded transformers model (same weights and dtype): for tests and comparisons."""
    config = model.config.get_text_config(decoder=True)
    raw = {k: v.detach() for k, v in model.state_dict().items()}
    weights = PreparedWeights(raw, quant, next(model.parameters()).dtype, cache_file=None)
    eos_ids = eos_token_ids(getattr(model, "generation_config", None), model.config, tokenizer)
    return build(config, weights, tokenizer, name, eos_ids)


def load(folder: Path, tokenizer, name: str, dtype, quant: str):
    """A native model from a transformers folder (config.json + *.safetensors), or None if its family has no
    native file or its weights are not in safetensors files."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(folder).get_text_config(decoder=True)
    if not supported(config) or not any(Path(folder).glob("*.safetensors")):
        return None
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json
        generation = None
    eos_ids = eos_token_ids(generation, config, tokenizer)
    raw = SafetensorsWeights(folder)
    weights = PreparedWeights(raw, quant, dtype, cache_file_for(raw, quant, dtype))
    return build(config, weights, tokenizer, name, eos_ids)


__all__ = ["FAMILIES", "QUANTS", "build", "from_transformers", "load", "supported"]
