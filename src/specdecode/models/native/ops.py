"""The tensor functions the native model files share: RMSNorm, rotary embeddings, tree attention over a KVCache,
gated MLP activations.

Two implementations of the row-wise ones (`RowOps`):
- TorchOps: torch's kernels, in the model's dtype (dense bfloat16/float32 weights).
- ExactOps: specdecode's own kernels (kernels/cpu.cpp), float32, each row reduced in a fixed order whatever the
  other rows are. Together with the quantized linear layers they make an N-row forward (a draft tree, a batch of
  requests) give bit for bit what N one-row forwards give, so speculative decoding of int4/int8 weights is
  token-identical to plain decoding of the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:  # [D/2]
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


class RotaryTable:
    """cos and sin per position, each computed once (in float64, rounded once) and kept: a position's rotation is
    then the same numbers in every forward, whatever else is in it (the halves layout: rotate_half pairs i with
    i + D/2). The table grows by appending the positions it lacks."""

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype):
        self.inv_freq, self.dtype = inv_freq.double(), dtype
        self.cos = self.sin = torch.empty(0, inv_freq.shape[0] * 2, dtype=dtype)  # [P, D]

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, q] -> 2 x [B, 1, q, D]
        have, top = self.cos.shape[0], int(positions.max()) + 1
        if top > have:
            new = torch.arange(have, max(top, 2 * have, 256), dtype=torch.float64)[:, None] * self.inv_freq
            new = torch.cat([new, new], dim=-1)  # [n, D]
            self.cos = torch.cat([self.cos, new.cos().to(self.dtype)])
            self.sin = torch.cat([self.sin, new.sin().to(self.dtype)])
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [B, H, q, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class Heads:
    """A model's attention heads: Hq query heads, Hkv key/value heads of D dimensions, scores scaled by `scale`
    (None: 1/sqrt(D))."""

    queries: int
    kv: int
    dim: int
    scale: float | None


class RowOps:
    """The steps of a decoder layer, composed of the row-wise ops below (ExactOps fuses them where it can)."""

    def linear(self, layer, x: torch.Tensor, *, norm=None, act: str | None = None, post_norm=None, residual=None,
               eps: float = 0.0) -> torch.Tensor:
        """layer(pre(x)), pre = rms_norm(x, norm) or act(gate) * up for x = [gate, up] (act "silu" or "gelu");
        then rms_norm(., post_norm) and + residual where given. x [M, K'] -> [M, N]. `layer`: a Linear, or any
        callable on [M, K] rows (a draft vocabulary's head)."""
        if norm is not None:
            x = self.rms_norm(x, norm, eps)
        elif act is not None:
            x = self.glu(x, act == "gelu")
        y = layer(x)
        if post_norm is not None:
            y = self.rms_norm(y, post_norm, eps)
        return y if residual is None else residual + y

    def attention_step(self, qkv, kv, layer: int, b: int, heads: Heads, q_norm, k_norm, eps: float, cos, sin,
                       mask) -> torch.Tensor:
        """Fused projections qkv [B*q, (Hq + 2 Hkv) D] -> per-head query/key norms (where given) -> rotary (cos, sin
        [B, 1, q, D]) -> new keys/values into the cache -> attention -> [B*q, Hq D]."""
        hq, hkv = heads.queries, heads.kv
        split = qkv.view(b, -1, hq + 2 * hkv, heads.dim).transpose(1, 2)  # [B, Hq + 2 Hkv, q, D]
        queries_keys = split[:, : hq + hkv]
        if q_norm is not None:
            queries = self.rms_norm(queries_keys[:, :hq], q_norm, eps)
            queries_keys = torch.cat([queries, self.rms_norm(queries_keys[:, hq:], k_norm, eps)], 1)
        rotated = self.rotary(queries_keys, cos, sin)  # queries and keys at once
        return self.attend(kv, layer, rotated[:, :hq], rotated[:, hq:], split[:, hq + hkv :], mask, heads.scale)


class TorchOps(RowOps):
    """Torch's kernels in the model's dtype."""

    exact = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., d]
        return F.rms_norm(x, weight.shape, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [B, H, q, D]
        return apply_rotary(x, cos, sin)

    def glu(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:  # [M, 2I] -> [M, I]
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up

    def attend(self, kv, layer, queries, keys, values, mask, scale=None) -> torch.Tensor:
        """Write the new keys/values into the cache's reserved slots, then attend over all entries so far.

        Grouped-query attention without copying keys: the G query heads that share a KV head are stacked as G*q
        query rows of that head (and the mask's rows repeated G times), so each KV head is read once."""
        b, hq, q, d = queries.shape
        hkv = keys.shape[1]
        group = hq // hkv
        all_keys, all_values = kv.update(layer, keys, values)  # [B, Hkv, keys, D]
        stacked = queries.reshape(b, hkv, group * q, d)  # rows g*q + i = query head kv*G + g, query i
        mask = None if mask is None else mask.repeat(1, group, 1)[:, None]  # [B, 1, G*q, keys]
        out = F.scaled_dot_product_attention(stacked, all_keys, all_values, attn_mask=mask, scale=scale)
        return out.view(b, hq, q, d).transpose(1, 2).reshape(b * q, hq * d)


class ExactOps(RowOps):
    """specdecode's kernels, float32, rows independent (see the module docstring). A quantized layer's steps run
    fused, one native call each: the same row functions in the same order, without a call per tensor op."""

    exact = True

    def __init__(self, kernels):
        self.kernels = kernels

    def linear(self, layer, x, *, norm=None, act=None, post_norm=None, residual=None, eps=0.0) -> torch.Tensor:
        if getattr(layer, "packed", None) is None:  # dense (inputs not a multiple of 32), or another callable
            return super().linear(layer, x, norm=norm, act=act, post_norm=post_norm, residual=residual, eps=eps)
        return self.kernels.fused_linear(
            x.float(), layer.packed, layer.bits, layer.out_features, layer.bias, norm, act, post_norm, residual, eps
        )

    def attention_step(self, qkv, kv, layer, b, heads, q_norm, k_norm, eps, cos, sin, mask) -> torch.Tensor:
        keys, values, slots, n_keys = kv.layer_store(layer, qkv.shape[0] // b)
        return self.kernels.attention_step(
            qkv, heads.queries, heads.kv, q_norm, k_norm, eps, cos[:, 0].contiguous(), sin[:, 0].contiguous(), keys,
            values, slots, n_keys, mask, heads.dim**-0.5 if heads.scale is None else heads.scale,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., d]
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        return self.kernels.rms_norm(rows, weight.float().contiguous(), eps).view(x.shape)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [B, H, q, D]
        """cos, sin [B, 1, q, D] (a RotaryTable's rows)."""
        return self.kernels.rotary(x, cos[:, 0].contiguous(), sin[:, 0].contiguous())

    def glu(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:  # [M, 2I] -> [M, I]
        return self.kernels.glu(gate_up.contiguous(), gelu)

    def attend(self, kv, layer, queries, keys, values, mask, scale=None) -> torch.Tensor:
        b, hq, q, d = queries.shape
        all_keys, all_values = kv.update(layer, keys, values)  # [B, Hkv, keys, D]
        scale = d**-0.5 if scale is None else scale
        out = self.kernels.tree_attention(queries.contiguous(), all_keys, all_values, mask, all_keys.shape[2], scale)
        return out.view(b * q, hq * d)  # [B*q, Hq*D]


def row_ops(exact: bool) -> TorchOps | ExactOps:
    """ExactOps where asked and the kernels build on this machine, else TorchOps."""
    from ... import kernels

    native = kernels.native() if exact else None
    return ExactOps(native) if native is not None else TorchOps()


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, q, D] for [B, q] positions, computed for this call (model files keep a RotaryTable)."""
    angles = positions.float()[:, None, :, None] * inv_freq  # [B, 1, q, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, 1, q, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def attend(kv, layer: int, queries, keys, values, mask, scale=None) -> torch.Tensor:  # [B*q, Hq*D]
    """Torch's attention over a KV cache (TorchOps.attend), for callers without a model (draft heads)."""
    return TorchOps().attend(kv, layer, queries, keys, values, mask, scale)
