"""The pieces every feature-level draft head shares: its config, one Llama decoder layer over a KV cache, and the
key/value store training uses instead of a KVCache.

A head's decoder layer takes its attention input and its residual separately (EAGLE-1 feeds fc's output as both;
EAGLE-3 feeds [norm(embedding), norm(hidden)] to attention and the hidden alone to the residual). Positions and the
attention mask are arguments; keys and values go through models/native/ops.attend, so at inference they live in
the engine's KVCache (drafted tree levels stay uncommitted until the drafter discards them)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..models.native.linear import GROUP
from ..models.native.linear import Linear as NativeLinear
from ..models.native.ops import apply_rotary, attend, inverse_frequencies, rotary
from .kinds import head_kind


class Linear(nn.Linear):
    """nn.Linear whose inference (no autograd) multiplies by a cached copy of the weight, made once and remade when
    the weight or bias changes (storage, version, dtype or device): by default a dense [in, out] copy (torch's CPU
    F.linear re-packs the [out, in] weight on every call, which at the one to a few rows of a draft step costs more
    than the product itself); after `quantize("int8")` on a CPU, the weight in specdecode's int8 format on its
    kernels (a draft step reads a quarter of the float32 bytes). Training runs nn.Linear unchanged, and drops the
    copy: its optimizer may change the weight in place without bumping its version (torch's fused AdamW does not),
    which the copy's key cannot see."""

    _inference: tuple | None = None  # (weight key, quant, [in, out] dense copy or native layer)
    quant: str | None = None  # the inference weights' format; None: the weight's own dtype

    def quantize(self, quant: str | None) -> None:
        """Infer with `quant` weights ("int8", "int4") from the next call on; None: the weight's dtype."""
        self.quant = quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            self._inference = None  # the step that follows may update the weight unseen by the key
            return super().forward(x)
        w = self.weight
        quant = self.quant if w.device.type == "cpu" and self.in_features % GROUP == 0 else None
        bias = self.bias
        key = (w.data_ptr(), w._version, w.dtype, w.device, None if bias is None else (bias.data_ptr(), bias._version))
        if self._inference is None or self._inference[:2] != (key, quant):
            layer = (w.detach().t().contiguous() if quant is None  # [in, out]
                     else NativeLinear.of(w.detach().float(), None if bias is None else bias.detach().float(), quant,
                                          torch.float32))
            self._inference = (key, quant, layer)
        layer = self._inference[2]
        if quant is not None:
            rows = x.reshape(-1, self.in_features).float()
            return layer(rows).view(*x.shape[:-1], self.out_features).to(x.dtype)
        y = torch.matmul(x.to(w.dtype), layer)
        return y if self.bias is None else y + self.bias


def quantize_head(head: nn.Module, quant: str | None) -> None:
    """Infer with every linear layer of a head in `quant` weights (see Linear.quantize); None: back to dense."""
    for module in head.modules():
        if isinstance(module, Linear):
            module.quantize(quant)


@dataclass
class HeadConfig:
    """Everything needed to rebuild a head; the target's shapes are copied in when the head is made for it."""

    kind: str  # a registered head kind (kinds.HEAD_KINDS)
    hidden_size: int
    vocab_size: int  # the target's vocabulary
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    draft_vocab_size: int = 0  # kinds with their own draft vocabulary: its size (0 = the target's vocabulary)
    # the target's hidden states the head reads (its kind's feature_layers): eagle3's fused inputs, an exit layer
    feature_layers: list[int] = field(default_factory=list)
    num_heads: int = 4  # medusa: how many tokens ahead it predicts
    norm_before_residual: bool = False  # eagle3: the residual takes the normalized hidden (speculators' flag)
    target: str = ""  # the target's name, for finding the head again
    target_architecture: str = ""  # e.g. LlamaForCausalLM (for the speculators verifier config)
    ttt_steps: int = 1  # eagle3: training-time-test steps it was trained with (informational)

    def __post_init__(self):
        head_kind(self.kind)  # a registered kind, or one clear error
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.draft_vocab_size = self.draft_vocab_size or self.vocab_size

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "HeadConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    def __init__(self, config: HeadConfig, in_size: int):
        super().__init__()
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = Linear(in_size, c.num_attention_heads * c.head_dim, bias=bias)
        self.k_proj = Linear(in_size, c.num_key_value_heads * c.head_dim, bias=bias)
        self.v_proj = Linear(in_size, c.num_key_value_heads * c.head_dim, bias=bias)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(c.head_dim, c.rope_theta), persistent=False)

    def forward(self, x, positions, kv, mask) -> torch.Tensor:
        """x [B, q, in] at positions [B, q]; kv stores this layer's keys (layer 0); mask [B, q, keys] bool."""
        b, q, _ = x.shape

        def heads(proj: nn.Linear, n: int) -> torch.Tensor:  # [B, n, q, D]
            return proj(x).view(b, q, n, self.head_dim).transpose(1, 2)

        cos, sin = rotary(positions, self.inv_freq, x.dtype)  # [B, 1, q, D]
        queries = apply_rotary(heads(self.q_proj, self.n_heads), cos, sin)
        keys = apply_rotary(heads(self.k_proj, self.n_kv_heads), cos, sin)
        values = heads(self.v_proj, self.n_kv_heads)
        out = attend(kv, 0, queries, keys, values.to(keys.dtype), mask)  # [B*q, Hq*D]
        return self.o_proj(out.view(b, q, -1))


class MLP(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, i, bias=False)
        self.up_proj = Linear(d, i, bias=False)
        self.down_proj = Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """residual + attention(attn_input), then + MLP(post_attention_layernorm(.)): a Llama block whose input norm
    (if any) the head applies itself."""

    def __init__(self, config: HeadConfig, in_size: int):
        super().__init__()
        self.self_attn = Attention(config, in_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, attn_input, residual, positions, kv, mask) -> torch.Tensor:  # [B, q, d]
        hidden = residual + self.self_attn(attn_input, positions, kv, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class SequenceKV:
    """The KVCache stand-in for training: update() appends a step's [B, H, T, D] keys to the earlier steps' (in
    autograd), so training-time test's unrolled steps attend over every step so far."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        if self.keys is None:
            self.keys, self.values = new_keys, new_values
        else:
            self.keys = torch.cat([self.keys, new_keys], dim=2)
            self.values = torch.cat([self.values, new_values], dim=2)
        return self.keys, self.values


def head_cache(config: HeadConfig, capacity: int, dtype: torch.dtype) -> KVCache:
    """The KV cache of a head's one decoder layer."""
    return KVCache(1, config.num_key_value_heads, config.head_dim, capacity, dtype)


def step_mask(length: int, step: int) -> torch.Tensor:
    """[T, (step+1) T] bool: training-time test's mask at unrolled step `step` over T positions: causal over the
    first step's keys, plus each later step's key at the query's own position (its chain of drafted ancestors)."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    diagonal = torch.eye(length, dtype=torch.bool)
    return torch.cat([causal] + [diagonal] * step, dim=1)
