"""The tensor functions the native model files share: RMSNorm, rotary embeddings, tree attention over a KVCache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...cache import KVBatch, KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [q, d]
    return F.rms_norm(x, weight.shape, weight, eps)


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:  # [D/2]
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, q, D] for [B, q] query positions (the halves layout: rotate_half pairs i with i + D/2)."""
    angles = positions.float()[:, None, :, None] * inv_freq  # [B, 1, q, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, 1, q, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [B, H, q, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend(
    kv: KVCache | KVBatch,
    layer: int,
    queries: torch.Tensor,  # [B, Hq, q, D], rotated
    keys: torch.Tensor,  # [B, Hkv, q, D], rotated
    values: torch.Tensor,  # [B, Hkv, q, D]
    mask: torch.Tensor | None,  # [B, q, keys] bool, None = everything visible
    scale: float | None = None,  # None = 1/sqrt(D)
) -> torch.Tensor:  # [B*q, Hq*D]
    """Write the new keys/values into the cache's reserved slots, then attend over all entries so far.

    Grouped-query attention without copying keys: the G query heads that share a KV head are stacked as G*q
    query rows of that head (and the mask's rows repeated G times), so each KV head is read once."""
    b, hq, q, d = queries.shape
    hkv = keys.shape[1]
    group = hq // hkv
    all_keys, all_values = kv.update(layer, keys, values)  # [B, Hkv, keys, D]
    stacked = queries.reshape(b, hkv, group * q, d)  # rows g*q + i = query head kv*G + g, query i
    mask = None if mask is None else mask.repeat(1, group, 1)[:, None]  # [B, 1, G*q, keys]
    out = F.scaled_dot_product_attention(stacked, all_keys, all_values, attn_mask=mask, scale=scale)  # [B, Hkv, G*q, D]
    return out.view(b, hq, q, d).transpose(1, 2).reshape(b * q, hq * d)
