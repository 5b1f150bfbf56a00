"""Where a native model's weights come from: safetensors files, and a disk cache of prepared (converted and
quantized) layers so that only the first load of a (model, quant, dtype) pays for quantization."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from ...files import partial_path
from .linear import GROUP, Linear, prepare

FORMAT = 2  # bump when prepare() changes what it stores


class SafetensorsWeights(Mapping):
    """The tensors of a folder's *.safetensors files, read one at a time in float32 when asked for."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        self.files = {}
        for path in sorted(self.folder.glob("*.safetensors")):
            handle = safe_open(path, "pt")
            self.files.update({key: handle for key in handle.keys()})

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.files[key].get_tensor(key).float()

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def fingerprint(self) -> str:
        stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(self.folder.glob("*.safetensors"))]
        return f"{self.folder.resolve()}:{stats}"


class PreparedWeights:
    """A model file's view of its weights: tensors in the model's dtype and Linear layers in the chosen format,
    read from the prepared-weights cache when an earlier load wrote it."""

    def __init__(self, raw: Mapping[str, torch.Tensor], quant: str, dtype: torch.dtype, cache_file: Path | None):
        self.raw, self.quant, self.dtype, self.cache_file = raw, quant, dtype, cache_file
        self.cached: dict[str, dict[str, torch.Tensor]] = {}  # key -> its prepared tensors
        if cache_file is not None and cache_file.exists():
            from safetensors.torch import load_file

            # copied out of the memory-mapped file: anonymous memory gets huge pages, which makes the matmuls that
            # stream the weights ~1.7x faster than reading them through 4 KB file pages
            for name, tensor in load_file(cache_file).items():
                key, _, part = name.rpartition("/")
                self.cached.setdefault(key, {})[part] = tensor.clone()
        self.prepared: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return name in self.raw

    def tensor(self, name: str) -> torch.Tensor:
        return self._cached_or(name, lambda: {"tensor": self.raw[name].to(self.dtype)})["tensor"]

    def linear(self, key: str, weight_names: list[str], bias_names: list[str] = ()) -> Linear:
        """One layer from the named weights stacked along the output dimension (e.g. q, k and v fused)."""

        def make():
            weight = torch.cat([self.raw[n] for n in weight_names])  # [N, K]
            biases = [self.raw[n] for n in bias_names if n in self.raw]
            return prepare(weight, torch.cat(biases) if biases else None, self.quant, self.dtype)

        return Linear(self._cached_or(key, make), self.quant)

    def _cached_or(self, key: str, make: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        tensors = self.cached.get(key)
        if tensors is None:
            tensors = make()
            self.prepared.update({f"{key}/{name}": t for name, t in tensors.items()})
        return tensors

    def save(self) -> None:
        """Write the cache file if this load prepared anything (atomically: a killed write leaves no file)."""
        if self.cache_file is None or not self.prepared:
            return
        from safetensors.torch import save_file

        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(self.cache_file)
        cached = {f"{key}/{name}": t for key, tensors in self.cached.items() for name, t in tensors.items()}
        save_file({**cached, **self.prepared}, partial)
        os.replace(partial, self.cache_file)


def cache_file_for(raw: SafetensorsWeights, quant: str, dtype: torch.dtype) -> Path | None:
    """None where caching would only copy the source (float32, not quantized)."""
    if quant == "none" and dtype == torch.float32:
        return None
    from ...files import cache_root

    machine = f"{torch.__version__}:{torch.backends.cpu.get_cpu_capability()}"
    key = f"{FORMAT}:{raw.fingerprint()}:{quant}:{dtype}:{GROUP}:{machine}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "prepared" / f"{raw.folder.parent.name}-{quant}-{str(dtype)[6:]}-{digest}.safetensors"
