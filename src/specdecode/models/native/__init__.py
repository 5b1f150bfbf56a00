"""The native CPU backend: our own small model file per family over the engine's KVCache, with bfloat16, int8 or
int4 weights. A family is one module with a CausalLM class and `supports(config)`, plus one line in FAMILIES."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from . import llama
from ..base import eos_token_ids
from .linear import QUANTS

FAMILIES = {"llama": llama, "qwen2": llama}  # config.model_type -> module


def supported(config) -> bool:
    family = FAMILIES.get(getattr(config, "model_type", None))
    return family is not None and family.supports(config)


def build(config, weights: Mapping[str, torch.Tensor], tokenizer, name: str, dtype, quant: str, eos_ids):
    return FAMILIES[config.model_type].Model(config, weights, tokenizer, name, dtype, quant, eos_ids)


def from_transformers(model, tokenizer, name: str, quant: str = "none"):
    """The native twin of a loaded transformers model (same weights and dtype): for tests and comparisons."""
    config = model.config.get_text_config(decoder=True)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    eos_ids = eos_token_ids(getattr(model, "generation_config", None), model.config, tokenizer)
    return build(config, weights, tokenizer, name, next(model.parameters()).dtype, quant, eos_ids)


def load(folder: Path, tokenizer, name: str, dtype, quant: str):
    """A native model from a transformers folder (config.json + *.safetensors), or None if its family has no
    native file."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(folder).get_text_config(decoder=True)
    if not supported(config):
        return None
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json
        generation = None
    eos_ids = eos_token_ids(generation, config, tokenizer)
    return build(config, SafetensorsWeights(folder), tokenizer, name, dtype, quant, eos_ids)


class SafetensorsWeights(Mapping):
    """The tensors of a folder's *.safetensors files, read one at a time in float32 when asked for."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.files = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            handle = safe_open(path, "pt")
            self.files.update({key: handle for key in handle.keys()})

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.files[key].get_tensor(key).float()

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


__all__ = ["FAMILIES", "QUANTS", "SafetensorsWeights", "build", "from_transformers", "load", "supported"]
