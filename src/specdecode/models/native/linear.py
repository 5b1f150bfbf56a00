"""Weight-only quantized linear layers for the CPU, whose rows are independent.

int4: group-wise affine, a scale and a min (fp16) per 32 input weights (GGUF's Q4_1 layout of numbers).
int8: group-wise symmetric, an fp16 scale per 32 input weights (GGUF's Q8_0).
Both run on specdecode's own kernels (kernels/cpu.cpp): activations quantized to int8 per row and block of 32,
exact integer dot products per block, blocks summed in a fixed order. Each output row is then a function of its
own input row only: a tree verification over N rows gives bit for bit what N one-row decode steps give, and the
cost of a few extra rows is small (the weights are read once for all rows). The same kernels serve decode,
verification, batched verification and prefill; no de-quantized copy of the weights is kept.

Where the kernels cannot be built (no compiler), the layer runs F.linear on weights de-quantized at load: the same
function of the same quantized weights, with torch's rounding and speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import kernels

QUANTS = ("none", "int8", "int4")
GROUP = 32  # inputs per quantization block
TILE = 16  # output columns per packed tile (kernels/cpu.cpp)
BITS = {"int4": 4, "int8": 8}


class Linear:
    """y = x @ weight.T + bias for x [M, K], from the tensors `prepare` made of weight [N, K]:
    dense [N, K] (not quantized), or packed [tiles, K/32, bytes] + shape [N, K]; bias [N] (optional)."""

    def __init__(self, tensors: dict[str, torch.Tensor], quant: str):
        self.bias = tensors.get("bias")
        self.packed = tensors.get("packed")
        self.quant = quant if self.packed is not None else "none"
        self.bits = BITS.get(self.quant)  # of the packed weights
        self.dense = tensors.get("dense")
        if self.packed is None:
            self.out_features, self.in_features = self.dense.shape
        else:
            self.out_features, self.in_features = (int(v) for v in tensors["shape"])
            self.kernels = kernels.native()
            if self.kernels is None:  # torch fallback: de-quantize once
                self.dense = dequantize(self.packed, self.quant)[: self.out_features].to(torch.bfloat16)

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, quant: str, dtype: torch.dtype) -> "Linear":
        return cls(prepare(weight, bias, quant, dtype), quant)

    def weight(self) -> torch.Tensor:  # [N, K] float32
        """The weights this layer multiplies by (de-quantized when quantized), e.g. for training a draft head."""
        if self.packed is None:
            return self.dense.float()
        return dequantize(self.packed, self.quant)[: self.out_features]

    def select_outputs(self, ids: torch.Tensor) -> "Linear":
        """The layer of the output features `ids` [n] only (a draft vocabulary's rows of an LM head). Quantized, the
        packed bytes are moved, not re-quantized, and each of those outputs gets the same numbers bit for bit."""
        tensors = {"bias": self.bias[ids]} if self.bias is not None else {}
        if self.packed is None:
            return Linear({"dense": self.dense[ids].contiguous(), **tensors}, "none")
        packed = _select_columns(self.packed, self.quant, ids)
        return Linear({"packed": packed, "shape": torch.tensor([len(ids), self.in_features]), **tensors}, self.quant)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.dense is not None:
            y = F.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)
        else:
            y = self.kernels.quant_linear(x.float().contiguous(), self.packed, self.bits)  # [M, tiles*16]
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features].contiguous()
        return y if self.bias is None else y + self.bias.to(y.dtype)


def prepare(weight: torch.Tensor, bias: torch.Tensor | None, quant: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a Linear runs on (what the prepared-weights cache stores). Quantized layers compute in float32
    whatever `dtype` is (it sets the dense layers' dtype)."""
    n, k = weight.shape
    if quant in BITS and k % GROUP == 0:
        tensors = {"packed": pack(weight, quant), "shape": torch.tensor([n, k])}
        if bias is not None:
            tensors["bias"] = bias.float()
        return tensors
    # dense (also a quantized layer whose input width is not a multiple of the group)
    tensors = {"dense": weight.to(dtype).contiguous()}  # [N, K]
    if bias is not None:
        tensors["bias"] = bias.to(dtype)
    return tensors


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes [N, K] uint8 in 0..15, scales [N, K/G] fp16, mins [N, K/G] fp16);
    w ~ scale * code + min."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)  # [N, K/G, G]
    low, high = groups.amin(-1), groups.amax(-1)  # [N, K/G]
    scales = ((high - low) / 15).clamp(min=2.0**-24).half()
    mins = low.half()
    codes = ((groups - mins.float()[..., None]) / scales.float()[..., None]).round().clamp(0, 15).to(torch.uint8)
    return codes.reshape(n, k), scales, mins


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes [N, K] int8 in -127..127, scales [N, K/G] fp16); w ~ scale * code."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)  # [N, K/G, G]
    scales = (groups.abs().amax(-1) / 127).clamp(min=2.0**-24).half()  # [N, K/G]
    codes = (groups / scales.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scales


def pack(weight: torch.Tensor, quant: str) -> torch.Tensor:
    """weight [N, K] -> [tiles, K/32, bytes] uint8 in the kernels' tile layout (see kernels/cpu.cpp); N is padded
    with zero columns to a multiple of 16."""
    n, k = weight.shape
    padded = -(-n // TILE) * TILE
    weight = F.pad(weight.float(), (0, 0, 0, padded - n))
    tiles, blocks = padded // TILE, k // GROUP

    def by_tile(t: torch.Tensor) -> torch.Tensor:  # [N, K/G, ...] -> [tiles, K/G, 16, ...]
        return t.reshape(tiles, TILE, blocks, *t.shape[2:]).transpose(1, 2)

    def scale_bytes(t: torch.Tensor) -> torch.Tensor:  # [N, K/G] fp16 -> [tiles, K/G, 32]
        return by_tile(t).contiguous().view(torch.uint8).reshape(tiles, blocks, 2 * TILE)

    if quant == "int4":
        codes, scales, mins = quantize_int4(weight)
        nibbles = codes.reshape(padded, blocks, 2, 4, 4)  # [N, K/G, low|high half, chunk c, byte i]
        data = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)  # [N, K/G, c, i]
        data = by_tile(data).permute(0, 1, 3, 2, 4).reshape(tiles, blocks, 4 * 64)  # [tiles, K/G, c, col, i]
        return torch.cat([data, scale_bytes(scales), scale_bytes(mins)], dim=-1).contiguous()
    codes, scales = quantize_int8(weight)
    data = codes.view(torch.uint8).reshape(padded, blocks, 8, 4)  # [N, K/G, chunk c, byte i]
    data = by_tile(data).permute(0, 1, 3, 2, 4).reshape(tiles, blocks, 8 * 64)
    return torch.cat([data, scale_bytes(scales)], dim=-1).contiguous()


def dequantize(packed: torch.Tensor, quant: str) -> torch.Tensor:
    """[tiles, K/32, bytes] -> the [tiles*16, K] float32 weights the kernels multiply by."""
    tiles, blocks, _ = packed.shape
    chunks = 4 if quant == "int4" else 8
    data = packed[..., : chunks * 64].reshape(tiles, blocks, chunks, TILE, 4).permute(0, 3, 1, 2, 4)
    scales = _scales(packed[..., chunks * 64 : chunks * 64 + 2 * TILE])  # [tiles*16, K/G]
    if quant == "int4":
        halves = torch.stack([data & 15, data >> 4], dim=3)  # [tiles, 16, K/G, 2, c, i]
        codes = halves.reshape(tiles * TILE, blocks, GROUP).float()
        mins = _scales(packed[..., 4 * 64 + 2 * TILE :])
        weight = codes * scales[..., None] + mins[..., None]
    else:
        codes = data.contiguous().view(torch.int8).reshape(tiles * TILE, blocks, GROUP).float()
        weight = codes * scales[..., None]
    return weight.reshape(tiles * TILE, blocks * GROUP)


def _select_columns(packed: torch.Tensor, quant: str, ids: torch.Tensor) -> torch.Tensor:
    """[tiles, K/G, bytes] -> the same layout holding only output columns `ids` (zero columns pad the last tile)."""
    tiles, blocks, size = packed.shape
    chunks = 4 if quant == "int4" else 8
    n = ids.shape[0]
    padded = -(-n // TILE) * TILE
    codes = packed[..., : chunks * 64].reshape(tiles, blocks, chunks, TILE, 4).permute(0, 3, 1, 2, 4)
    codes = codes.reshape(tiles * TILE, blocks, chunks, 4)[ids]  # [n, K/G, c, i]
    numbers = packed[..., chunks * 64 :].reshape(tiles, blocks, -1, TILE, 2).permute(0, 3, 1, 2, 4)
    numbers = numbers.reshape(tiles * TILE, blocks, -1, 2)[ids]  # [n, K/G, scale|min, 2 bytes]
    codes = F.pad(codes, (0, 0, 0, 0, 0, 0, 0, padded - n))
    numbers = F.pad(numbers, (0, 0, 0, 0, 0, 0, 0, padded - n))
    codes = codes.reshape(padded // TILE, TILE, blocks, chunks, 4).permute(0, 2, 3, 1, 4)
    numbers = numbers.reshape(padded // TILE, TILE, blocks, -1, 2).permute(0, 2, 3, 1, 4)
    out = torch.cat([codes.reshape(padded // TILE, blocks, -1), numbers.reshape(padded // TILE, blocks, -1)], -1)
    assert out.shape[-1] == size
    return out.contiguous()


def _scales(raw: torch.Tensor) -> torch.Tensor:  # [tiles, K/G, 32] uint8 -> [tiles*16, K/G] float32
    tiles, blocks, _ = raw.shape
    return raw.contiguous().view(torch.float16).float().reshape(tiles, blocks, TILE).transpose(1, 2).reshape(-1, blocks)
