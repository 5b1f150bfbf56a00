"""Weight-only quantized linear layers for the CPU, each using the fastest kernel for the number of rows.

int4: group-wise affine (a scale and a zero per group of 32 input weights, as in GGUF Q4_K and gpt-fast), run by
torch's `_weight_int4pack_mm_for_cpu`. int8: per-output-channel symmetric, run by `_weight_int8pack_mm`. Both
kernels read 2-4x fewer bytes than bfloat16 at one row, but their cost grows with the rows (they de-quantize per
row block), so above `packed_rows` rows (tree verification, prefill) a dense copy of the *de-quantized* weights is
used instead. The two routes compute the same function of the same quantized weights: only the rounding order
differs, as between any two batch shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTS = ("none", "int8", "int4")
GROUP = 32  # int4 group size (GGUF Q4_K's sub-block)
# Most rows for which the packed kernel beats the dense de-quantized weights, measured on a 2-core AVX-512 EPYC
# (benchmarks/kernels.py): int4 is ahead up to about 16 rows, int8 up to about 8.
PACKED_ROWS = {"int4": 16, "int8": 8}


class Linear:
    """y = x @ weight.T + bias for x [M, K], from the tensors `prepare` made of weight [N, K]:
    dense [N, K] (de-quantized when quantized), bias [N] (optional), packed + scales (quantized only)."""

    def __init__(self, tensors: dict[str, torch.Tensor], quant: str):
        self.quant = quant
        self.dense, self.bias = tensors["dense"], tensors.get("bias")
        self.packed, self.scales = tensors.get("packed"), tensors.get("scales")
        self.packed_rows = PACKED_ROWS.get(quant, 0) if self.packed is not None else 0

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, quant: str, dtype: torch.dtype) -> "Linear":
        return cls(prepare(weight, bias, quant, dtype), quant)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if x.shape[0] > self.packed_rows:
            return F.linear(x, self.dense, self.bias)
        if self.quant == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales)
        else:
            y = torch._weight_int8pack_mm(x, self.packed, self.scales)
        return y if self.bias is None else y + self.bias


def prepare(weight: torch.Tensor, bias: torch.Tensor | None, quant: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a Linear runs on (what the prepared-weights cache stores)."""
    tensors = {} if bias is None else {"bias": bias.to(dtype)}
    if quant == "int4" and weight.shape[1] % GROUP == 0:
        tensors.update(_int4(weight, dtype))
    elif quant == "int8":
        tensors.update(_int8(weight, dtype))
    else:  # dense (also an int4 layer whose input width is not a multiple of the group)
        tensors["dense"] = weight.to(dtype).contiguous()  # [N, K]
    return tensors


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes [N, K] int32 in 0..15, scales [N, K/G], zeros [N, K/G]); w ~ (code - 8) * scale + zero."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)  # [N, K/G, G]
    low, high = groups.amin(-1), groups.amax(-1)  # [N, K/G]
    scales = ((high - low) / 15).clamp(min=1e-10)
    codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32)
    return codes.reshape(n, k), scales, low + 8 * scales


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    groups = codes.reshape(n, k // GROUP, GROUP).float()
    return ((groups - 8) * scales[..., None] + zeros[..., None]).reshape(n, k)  # [N, K]


def _int4(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    codes, scales, zeros = quantize_int4(weight)
    scales, zeros = scales.to(dtype), zeros.to(dtype)  # the kernel's own rounding, applied to the dense copy too
    return {
        "dense": dequantize_int4(codes, scales.float(), zeros.float()).to(dtype),  # [N, K]
        "packed": torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),  # [N, K/2] uint8
        "scales": torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous(),  # [K/G, N, 2]
    }


def _int8(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    scales = (weight.float().abs().amax(1) / 127).clamp(min=1e-10)  # [N]
    codes = (weight.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)  # [N, K]
    scales = scales.to(dtype)
    return {"dense": (codes.float() * scales.float()[:, None]).to(dtype), "packed": codes, "scales": scales}
