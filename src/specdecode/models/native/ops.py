"""The tensor functions the native model files share: RMSNorm, rotary embeddings, tree attention over a KVCache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...cache import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [q, d]
    """Normalised in float32, scaled in the model's dtype (the reference implementations' order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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
    """Write the new keys/values into the cache's reserved slots, then attend over all entries so far."""
    all_keys, all_values = cache.update(layer, keys[None], values[None])  # [1, Hkv, end+q, D]
    out = F.scaled_dot_product_attention(
        queries[None], all_keys, all_values, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [1, Hq, q, D]
    return out[0].transpose(0, 1).reshape(queries.shape[1], -1)
