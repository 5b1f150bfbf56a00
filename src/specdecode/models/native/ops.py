"""The tensor functions the native model files share: RMSNorm, rotary embeddings, tree attention over a KVCache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...cache import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [q, d]
    return F.rms_norm(x, weight.shape, weight, eps)


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:  # [D/2]
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [q, D] for the query positions (the halves layout: rotate_half pairs i with i + D/2)."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [q, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [q, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [H, q, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend(
    cache: KVCache,
    layer: int,
    queries: torch.Tensor,  # [Hq, q, D], rotated
    keys: torch.Tensor,  # [Hkv, q, D], rotated
    values: torch.Tensor,  # [Hkv, q, D]
    mask: torch.Tensor | None,  # [q, end+q] bool, None = everything visible
    scale: float | None = None,
) -> torch.Tensor:  # [q, Hq*D]
    """Write the new keys/values into the cache's reserved slots, then attend over all entries so far.

    Grouped-query attention without copying keys: the G query heads that share a KV head are stacked as G*q
    query rows of that head (and the mask's rows repeated G times), so each KV head is read once."""
    hq, q, d = queries.shape
    hkv = keys.shape[0]
    group = hq // hkv
    all_keys, all_values = cache.update(layer, keys[None], values[None])  # [1, Hkv, end+q, D]
    stacked = queries.reshape(hkv, group * q, d)  # [Hkv, G*q, D]: rows g*q + i = head (kv*G + g), query i
    mask = None if mask is None else mask.repeat(group, 1)  # [G*q, end+q]
    out = F.scaled_dot_product_attention(stacked[None], all_keys, all_values, attn_mask=mask, scale=scale)
    return out.view(hq, q, d).transpose(0, 1).reshape(q, hq * d)  # [q, Hq*D]
