"""Any transformers causal LM as a CausalLM: our KVCache behind transformers' Cache API, our 4-D tree mask."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..cache import KVCache
from ..tree import PROBE
from .base import CausalLM, attention_mask


class _CacheView(Cache):
    """Lets transformers' attention layers write into a KVCache at the reserved slots."""

    def __init__(self, kv: KVCache, n_layers: int):
        super().__init__(layers=[])
        self.kv = kv
        self.n_layers = n_layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.kv.update(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv.end

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.n_layers


class HFModel(CausalLM):
    def __init__(self, model, tokenizer, name: str):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        config = model.config.get_text_config(decoder=True)
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(config, "max_position_embeddings", 4096))
        self.n_layers = config.num_hidden_layers
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * self.n_layers
        self.layer_types = sorted(set(layer_types))
        self.sliding_window = getattr(config, "sliding_window", None)
        self.eos_token_ids = _eos_ids(model, tokenizer)

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.dtype)

    @torch.inference_mode()
    def forward(self, cache, input_ids, positions, tree_mask, last_only=False, probe_embedding=None):
        q = input_ids.shape[0]
        cache.reserve(positions)
        masks = {kind: self._additive(cache, q, tree_mask, kind) for kind in self.layer_types}
        inputs = {"input_ids": input_ids[None]}
        if probe_embedding is not None:
            embeds = self.embed(input_ids.clamp(min=0))  # [q, H]
            embeds[input_ids == PROBE] = probe_embedding.to(embeds.dtype)
            inputs = {"inputs_embeds": embeds[None]}
        out = self.model(
            **inputs,
            position_ids=positions[None],
            attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),
            cache=_CacheView(cache, self.n_layers),
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        cache.advance(q)
        return out.logits[0].float()  # [q or 1, V]

    @torch.inference_mode()
    def embed(self, token_ids):
        return self.model.get_input_embeddings()(token_ids)  # [q, H], scaled as the model scales them

    def _additive(self, cache: KVCache, q: int, tree_mask: torch.Tensor, kind: str) -> torch.Tensor:
        window = self.sliding_window if kind == "sliding_attention" else None
        allowed = attention_mask(cache, q, tree_mask, window)  # [q, end+q]
        additive = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return additive[None, None]  # [1, 1, q, end+q]


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return frozenset(int(i) for i in ids)
