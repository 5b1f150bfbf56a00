"""Any transformers causal LM as a CausalLM: our KVCache behind transformers' Cache API, our 4-D tree mask.

forward_batch runs requests whose caches sit in consecutive slots of one KVPool as one padded batch: the caches are
read and written in place (a KVBatch) and each row gets its own 4-D mask (committed prefix, tree, padding hidden)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from ..cache import KVBatch, KVCache
from .base import (
    BatchInputs, CausalLM, ForwardRequest, attention_mask, batch_attention_mask, eos_token_ids, fill_hidden,
    needs_native_backend, place_probes, wanted_layers,
)


LLAMA_LAYERS = ("llama", "qwen2", "mistral")  # transformers model types whose decoder layer is a Llama block


class _CacheView(Cache):
    """Lets transformers' attention layers write into a KVCache (or a KVBatch) at the reserved slots."""

    def __init__(self, kv: KVCache | KVBatch, n_layers: int):
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
        self.text_config = config = model.config.get_text_config(decoder=True)
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(config, "max_position_embeddings", 4096))
        self.n_layers = config.num_hidden_layers
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * self.n_layers
        self.layer_types = sorted(set(layer_types))
        self.sliding_window = getattr(config, "sliding_window", None)
        self.eos_token_ids = eos_token_ids(getattr(model, "generation_config", None), model.config, tokenizer)

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.dtype)

    @torch.inference_mode()
    def forward(self, cache, input_ids, positions, tree_mask, last_only=False, probe_embedding=None, hidden=None,
                resume=None):
        if resume is not None:  # transformers runs every layer (self-speculative drafters refuse this backend)
            raise needs_native_backend(self)
        q = input_ids.shape[0]
        cache.reserve(positions)
        masks = {kind: self._additive(attention_mask(cache, q, tree_mask, self._window(kind)))[None, None]
                 for kind in self.layer_types}  # [1, 1, q, end+q] each
        view = _CacheView(cache, self.n_layers)
        layers = wanted_layers([hidden], self.n_layers)
        with self._capture(layers) as captured:
            logits = self._run(input_ids[None], positions[None], masks, view, last_only, [probe_embedding])
        cache.advance(q)
        if layers:
            fill_hidden([hidden], layers, torch.stack(captured, 1), [q])
        return logits[0]  # [q or 1, V]

    @torch.inference_mode()
    def forward_batch(self, requests: list[ForwardRequest]) -> list[torch.Tensor]:
        batch = BatchInputs.of(requests)
        if batch is None:  # not in consecutive slots of one pool: one forward each
            return super().forward_batch(requests)
        kv, input_ids, positions, lengths, q = batch.kv, batch.input_ids, batch.positions, batch.lengths, batch.q
        kv.reserve(positions)
        masks = {kind: self._additive(batch_attention_mask(requests, q, kv.key_count, self._window(kind)))[:, None]
                 for kind in self.layer_types}  # [B, 1, q, key_count] each
        view = _CacheView(kv, self.n_layers)
        layers = wanted_layers(batch.hidden, self.n_layers)
        with self._capture(layers) as captured:
            logits = self._run(input_ids, positions, masks, view, False, batch.probe_embeddings)  # [B, q, V]
        kv.advance(lengths)
        if layers:
            fill_hidden(batch.hidden, layers, torch.stack(captured, 1), lengths)
        return [logits[row, :length] for row, length in enumerate(lengths)]

    def _run(self, input_ids, positions, masks: dict, cache: _CacheView, last_only: bool, probes) -> torch.Tensor:
        """[B, q or 1, V] float32 logits of one transformers forward."""
        inputs = {"input_ids": input_ids}
        if any(probe is not None for probe in probes):
            inputs = {"inputs_embeds": place_probes(self.embed(input_ids.clamp(min=0)), input_ids, probes)}
        out = self.model(
            **inputs,
            position_ids=positions,
            attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),
            cache=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        return out.logits.float()

    @contextmanager
    def _capture(self, layers: tuple[int, ...]):
        """While open, the list it yields collects the [B, q, H] input of each layer in `layers` (n_layers: the
        input of the final norm), in that order, through forward pre-hooks that exist only for this forward."""
        captured: list[torch.Tensor] = []
        decoder = self.model.get_decoder()
        modules = [decoder.layers[layer] if layer < self.n_layers else decoder.norm for layer in layers]
        record = lambda module, args, kwargs: captured.append(  # noqa: E731
            (args[0] if args else kwargs["hidden_states"]).clone()
        )
        handles = [module.register_forward_pre_hook(record, with_kwargs=True) for module in modules]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    @torch.inference_mode()
    def final_norm(self, hidden):  # [..., H] -> [..., H]
        return self.model.get_decoder().norm(hidden)

    @torch.inference_mode()
    def lm_head_logits(self, hidden):  # [..., H] -> [..., V] float32
        return self.model.get_output_embeddings()(hidden).float()

    def _window(self, kind: str) -> int | None:
        return self.sliding_window if kind == "sliding_attention" else None

    @torch.inference_mode()
    def embed(self, token_ids):
        return self.model.get_input_embeddings()(token_ids)  # [..., H], scaled as the model scales them

    def decoder_shapes(self) -> dict:
        c = self.text_config
        rope = getattr(c, "rope_parameters", None) or {}
        return dict(
            hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads or c.num_attention_heads, head_dim=self.head_dim,
            intermediate_size=c.intermediate_size, rms_norm_eps=float(c.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            target_architecture=(self.model.config.architectures or [type(self.model).__name__])[0],
        )

    @torch.no_grad()  # not inference_mode: training multiplies by these under autograd
    def frozen_weights(self) -> dict[str, torch.Tensor]:
        return {"embedding": self.model.get_input_embeddings().weight.detach().float(),
                "norm": self.model.get_decoder().norm.weight.detach().float(),
                "lm_head": self.model.get_output_embeddings().weight.detach().float()}

    @torch.no_grad()
    def lm_head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings().weight[token_ids].float()

    @torch.no_grad()
    def last_layer_weights(self) -> dict[str, torch.Tensor] | None:
        if self.text_config.model_type not in LLAMA_LAYERS:
            return None
        return {k: v.float().clone() for k, v in self.model.get_decoder().layers[-1].state_dict().items()}

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A bool mask as the additive float mask transformers takes: 0 where allowed, the dtype's minimum elsewhere."""
        return torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
