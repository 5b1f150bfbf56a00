"""The Llama architecture (Llama, SmolLM2; Qwen2 = the same with q/k/v biases), written for the engine: pre-norm
blocks, grouped-query attention with rotary positions, SwiGLU MLP. Positions and the tree mask are arguments; the
KV cache is the engine's preallocated KVCache; every matmul is a `Linear` in the chosen weight format.

With int4/int8 weights the model computes in float32 on specdecode's row-exact kernels (ops.ExactOps): every row of
a forward is then computed exactly as it would be alone, so verifying a draft tree or a batch of requests gives the
same bits as decoding one token at a time. Dense weights run on torch's kernels in their dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ...cache import KVCache
from ...cache.kv import KV_DTYPES
from ...errors import SpecDecodeError
from ..base import (
    BatchInputs, CausalLM, ForwardRequest, Resume, Sublayers, attention_mask, batch_attention_mask, fill_hidden,
    place_probes, wanted_layers,
)
from .linear import TILE, Linear, dequantize
from .weights import PreparedWeights
from .ops import Heads, RotaryTable, inverse_frequencies, row_ops


@dataclass
class Block:
    attn_norm: torch.Tensor  # [d]
    qkv: Linear  # [(Hq + 2 Hkv) D, d]: q, k and v fused into one matmul
    out: Linear  # [d, Hq D]
    mlp_norm: torch.Tensor  # [d]
    gate_up: Linear  # [2 I, d]: gate and up fused
    down: Linear  # [d, I]
    # what other families add (None in Llama): norms of each sublayer's output, per-head query and key norms
    post_attn_norm: torch.Tensor | None = None  # [d]
    post_mlp_norm: torch.Tensor | None = None  # [d]
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None  # [D]


class LlamaModel(CausalLM):
    act = "silu"  # the MLP's gate activation: "silu" (Llama), or "gelu" (the tanh approximation)
    runs_sublayers = True

    def __init__(self, config, weights: PreparedWeights, tokenizer, name: str, eos_ids):
        self.name, self.tokenizer, self.quant = name, tokenizer, weights.quant
        self.ops = row_ops(exact=self.quant != "none")
        self.dtype = torch.float32 if self.ops.exact else weights.dtype  # what activations and the KV cache hold
        self.eos_token_ids = frozenset(eos_ids)
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        self.max_context = int(config.max_position_embeddings)
        # Attention kinds: kind -> (rotary inverse frequencies [D/2], sliding window or None); the kind of each layer
        self.kinds = {"full": (inverse_frequencies(self.head_dim, _rope_theta(config)), None)}
        self.layer_kinds = ["full"] * self.n_layers
        self.heads = Heads(self.n_heads, self.n_kv_heads, self.head_dim, scale=None)  # None: 1/sqrt(head_dim)
        self.rotary: dict[str, RotaryTable] = {}  # attention kind -> its table, made on first use
        # tied weights are saved once, under either name
        embed = "model.embed_tokens.weight" if weights.has("model.embed_tokens.weight") else "lm_head.weight"
        head = "lm_head.weight" if weights.has("lm_head.weight") else embed
        self.embedding = weights.tensor(embed)  # [V, d]
        self.vocab_size = self.embedding.shape[0]
        self.blocks = [
            self._block(weights, f"model.layers.{i}.")
            for i in tqdm(range(self.n_layers), desc=f"{name} ({self.quant})", unit="layer", leave=False)
        ]
        self.norm = self.param(weights, "model.norm.weight")  # [d]
        self.lm_head = weights.linear("lm_head", [head])

    def _block(self, weights: PreparedWeights, prefix: str) -> Block:
        attn = [f"{prefix}self_attn.{p}_proj" for p in "qkv"]
        mlp = [f"{prefix}mlp.{p}_proj.weight" for p in ("gate", "up")]
        return Block(
            attn_norm=self.param(weights, prefix + "input_layernorm.weight"),
            qkv=weights.linear(prefix + "qkv", [p + ".weight" for p in attn], [p + ".bias" for p in attn]),
            out=weights.linear(prefix + "o", [prefix + "self_attn.o_proj.weight"]),
            mlp_norm=self.param(weights, prefix + "post_attention_layernorm.weight"),
            gate_up=weights.linear(prefix + "gate_up", mlp),
            down=weights.linear(prefix + "down", [prefix + "mlp.down_proj.weight"]),
        )

    def param(self, weights: PreparedWeights, name: str) -> torch.Tensor:
        """A small tensor (a norm's weight) in the compute dtype."""
        return weights.tensor(name).to(self.dtype)

    def new_cache(self, capacity: int) -> KVCache:
        dtype = KV_DTYPES.get(self.kv_cache, self.dtype)  # auto: the compute dtype
        return KVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, dtype)

    def use_kv_cache(self, kv_cache: str) -> None:
        """f32, bf16 or int8 keys and values for the row-exact kernels (they read each; every row reads the same
        rounded entries, so rows stay exact); torch's kernels keep the compute dtype."""
        if kv_cache != "auto" and not self.ops.exact:
            super().use_kv_cache(kv_cache)
        self.kv_cache = kv_cache

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., d]
        return self.embedding[token_ids].to(self.dtype)

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., d]
        return self.ops.rms_norm(hidden, self.norm, self.eps)

    @torch.inference_mode()
    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., V] float32
        return self.lm_head(hidden.reshape(-1, hidden.shape[-1])).float().view(*hidden.shape[:-1], -1)

    def decoder_shapes(self) -> dict:
        inv_freq = next(iter(self.kinds.values()))[0]  # the full-attention layers' rotary frequencies
        return dict(
            hidden_size=self.embedding.shape[1], num_attention_heads=self.n_heads, num_key_value_heads=self.n_kv_heads,
            head_dim=self.head_dim, intermediate_size=self.blocks[0].down.in_features, rms_norm_eps=float(self.eps),
            rope_theta=float(inv_freq[1] ** (-self.head_dim / 2)) if inv_freq.numel() > 1 else 10000.0,
            target_architecture=type(self).__name__,
        )

    def frozen_weights(self) -> dict[str, torch.Tensor]:
        return {"embedding": self.embedding.float(), "norm": self.norm.float(), "lm_head": self.lm_head.weight()}

    @torch.no_grad()  # not inference_mode: training multiplies by these rows under autograd
    def lm_head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if head.dense is not None:
            return head.dense[token_ids].float()
        tiles = torch.unique(token_ids // TILE)  # [t]: the packed tiles holding these rows
        rows = dequantize(head.packed[tiles], head.quant)  # [t * TILE, d]
        where = torch.searchsorted(tiles, token_ids // TILE) * TILE + token_ids % TILE
        return rows[where]

    @torch.no_grad()
    def last_layer_weights(self) -> dict[str, torch.Tensor] | None:
        block = self.blocks[-1]
        if self.act != "silu" or block.post_attn_norm is not None or block.q_norm is not None:
            return None
        sizes = [self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2
        layer = {"input_layernorm.weight": block.attn_norm.float(),
                 "post_attention_layernorm.weight": block.mlp_norm.float(),
                 "self_attn.o_proj.weight": block.out.weight(), "mlp.down_proj.weight": block.down.weight()}
        for name, weight in zip("qkv", block.qkv.weight().split(sizes)):
            layer[f"self_attn.{name}_proj.weight"] = weight
        if block.qkv.bias is not None:
            for name, bias in zip("qkv", block.qkv.bias.float().split(sizes)):
                layer[f"self_attn.{name}_proj.bias"] = bias
        gate, up = block.gate_up.weight().chunk(2)
        layer.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
        return layer

    @torch.inference_mode()
    def forward(self, cache, input_ids, positions, tree_mask, last_only=False, probe_embedding=None, hidden=None,
                resume: Resume | None = None):
        q = input_ids.shape[0]
        layers = wanted_layers([hidden], self.n_layers)
        if resume is not None:
            if layers and layers[0] < resume.layer:
                raise SpecDecodeError(f"hidden states of layer {layers[0]} asked of a forward resumed at layer "
                                      f"{resume.layer}.", "Ask for layers at or above the exit layer.")
            cache.discard()  # write from the first uncommitted slot: the drafter's entries below resume.layer stay
        cache.reserve(positions)
        masks = self._masks(cache, q, tree_mask)
        probes = [probe_embedding]
        logits, captured = self._run(cache, input_ids[None], positions[None], masks, last_only, probes, layers, resume)
        cache.advance(q)
        if layers:
            fill_hidden([hidden], layers, captured, [q])
        return logits[0]  # [q or 1, V]

    @torch.inference_mode()
    def forward_sublayers(self, cache, input_ids, positions, tree_mask, sublayers: Sublayers) -> torch.Tensor:
        sublayers.check(self.n_layers)
        q = input_ids.shape[0]
        cache.reserve(positions)
        masks = self._masks(cache, q, tree_mask)
        hidden = self.embed(input_ids)  # [q, d]
        hidden, _ = self._blocks(cache, hidden, 1, positions[None], masks, range(sublayers.stop), sublayers)
        cache.advance(q)
        return hidden  # [q, d]

    @torch.inference_mode()
    def attention_probs(self, cache, layer, states, positions) -> torch.Tensor:
        block, hq, hkv, d = self.blocks[layer], self.n_heads, self.n_kv_heads, self.head_dim
        q = states.shape[0]
        qkv = self.ops.linear(block.qkv, states.to(self.dtype), norm=block.attn_norm, eps=self.eps)  # [q, (Hq+2Hkv)D]
        queries = qkv[:, : hq * d].reshape(1, q, hq, d).transpose(1, 2).contiguous()  # [1, Hq, q, D]
        if block.q_norm is not None:
            queries = self.ops.rms_norm(queries, block.q_norm, self.eps)
        cos, sin = self._rotary(self.layer_kinds[layer])(positions[None])  # [1, 1, q, D]
        queries = self.ops.rotary(queries.contiguous(), cos, sin)[0].float()  # [Hq, q, D]
        queries = queries.view(hkv, hq // hkv, q, d)  # [Hkv, G, q, D]
        keys = cache.layer_keys(layer)  # [Hkv, K, D]
        scale = d**-0.5 if self.heads.scale is None else self.heads.scale
        scores = torch.einsum("hgqd,hkd->hgqk", queries, keys) * scale  # [Hkv, G, q, K]
        hidden_keys = cache.positions[: cache.end][None, :] > positions[:, None]  # [q, K]: later than the query
        window = self.kinds[self.layer_kinds[layer]][1]
        if window is not None:
            hidden_keys |= (positions[:, None] - cache.positions[: cache.end][None, :]) >= window
        return scores.masked_fill(hidden_keys, float("-inf")).softmax(-1).view(hq, q, -1)

    def _masks(self, cache, q: int, tree_mask) -> dict:
        """Attention kind -> [1, q, end+q] bool, or None where a lone new token sees everything."""
        sees_all = q == 1 and cache.pending == 0 and cache.sliding is None  # and no window
        return {
            kind: None if sees_all and window is None else attention_mask(cache, q, tree_mask, window)[None]
            for kind, (_, window) in self.kinds.items()
        }

    @torch.inference_mode()
    def forward_batch(self, requests: list[ForwardRequest]) -> list[torch.Tensor]:
        batch = BatchInputs.of(requests)
        if batch is None:
            return super().forward_batch(requests)
        batch.kv.reserve(batch.positions)
        masks = {  # kind -> [B, q, keys]
            kind: batch_attention_mask(requests, batch.q, batch.kv.key_count, window)
            for kind, (_, window) in self.kinds.items()
        }
        layers = wanted_layers(batch.hidden, self.n_layers)
        logits, captured = self._run(
            batch.kv, batch.input_ids, batch.positions, masks, False, batch.probe_embeddings, layers
        )
        batch.kv.advance(batch.lengths)
        if layers:
            fill_hidden(batch.hidden, layers, captured, batch.lengths)
        return [logits[row, :length] for row, length in enumerate(batch.lengths)]

    def _run(self, kv, input_ids, positions, masks: dict, last_only: bool, probes, layers=(), resume=None):
        """[B, q] tokens at [B, q] positions -> ([B, q or 1, V] float32 logits, [B, len(layers), q, d] the inputs
        of those layers (n_layers: the last output, before the final norm), or None without layers); kv holds the
        reserved slots; masks: attention kind -> [B, q, keys] bool or None. With `resume` (B = 1) the layers below
        resume.layer are not run: their input is resume.states."""
        b, q = input_ids.shape
        first = 0 if resume is None else resume.layer
        if resume is not None:  # a copy: the layers update the residual stream in place
            hidden = resume.states.to(self.dtype).reshape(b * q, -1).clone()
        elif any(probe is not None for probe in probes):
            hidden = place_probes(self.embed(input_ids.clamp(min=0)), input_ids, probes).view(b * q, -1)
        else:
            hidden = self.embed(input_ids.reshape(-1))  # [B*q, d]: every matmul sees all rows at once
        hidden, captured = self._blocks(kv, hidden, b, positions, masks, range(first, self.n_layers), None, layers)
        states = torch.stack(captured).view(len(layers), b, q, -1).transpose(0, 1) if layers else None
        hidden = hidden.view(b, q, -1)
        if last_only:
            hidden = hidden[:, -1:]
        logits = self.ops.linear(self.lm_head, hidden.reshape(-1, hidden.shape[-1]), norm=self.norm, eps=self.eps)
        return logits.float().view(b, hidden.shape[1], -1), states

    def _blocks(self, kv, hidden, b: int, positions, masks: dict, run: range, skip: Sublayers | None = None,
                layers=()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The residual stream [B*q, d] through decoder layers `run` (minus skip's sublayers), and a copy of it
        entering each layer of `layers` in that range (run.stop included: the output)."""
        rotations = {kind: self._rotary(kind)(positions) for kind in self.kinds}  # kind -> cos, sin [B, 1, q, D]
        captured = []  # the residual stream entering each asked layer
        for layer in run:
            if layer in layers:
                captured.append(hidden.clone())  # a copy: a layer may update the residual stream in place
            kind, block = self.layer_kinds[layer], self.blocks[layer]
            attention = skip is None or layer not in skip.skip_attention
            mlp = skip is None or layer not in skip.skip_mlp
            hidden = self._layer(block, layer, kv, hidden, b, *rotations[kind], masks[kind], attention, mlp)
        if run.stop in layers:
            captured.append(hidden.clone())
        return hidden, captured

    def _rotary(self, kind: str) -> RotaryTable:
        if kind not in self.rotary:
            self.rotary[kind] = RotaryTable(self.kinds[kind][0], self.dtype)
        return self.rotary[kind]

    def _layer(self, block: Block, layer: int, kv, hidden, b: int, cos, sin, mask, attention=True, mlp=True):
        """One decoder layer on the residual stream [B*q, d] (updated in place where the ops fuse the residual add);
        a skipped sublayer (attention or mlp False) adds nothing and writes no cache entry."""
        ops, eps = self.ops, self.eps
        if attention:
            qkv = ops.linear(block.qkv, hidden, norm=block.attn_norm, eps=eps)  # [B*q, (Hq + 2 Hkv) D]
            attended = ops.attention_step(qkv, kv, layer, b, self.heads, block.q_norm, block.k_norm, eps, cos, sin,
                                          mask)  # [B*q, Hq D]
            hidden = ops.linear(block.out, attended, post_norm=block.post_attn_norm, residual=hidden, eps=eps)
        if mlp:
            gate_up = ops.linear(block.gate_up, hidden, norm=block.mlp_norm, eps=eps)  # [B*q, 2I]
            hidden = ops.linear(block.down, gate_up, act=self.act, post_norm=block.post_mlp_norm, residual=hidden,
                                eps=eps)
        return hidden


Model = LlamaModel


def supports(config) -> bool:
    """Plain RoPE, no sliding window: what this file implements."""
    rope = getattr(config, "rope_parameters", None) or {}
    window = getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
    return rope.get("rope_type", "default") == "default" and not window and config.hidden_act == "silu"


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
