"""Resolve --model: a shipped name, a local transformers folder, a .gguf file, or a hub id."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..errors import SpecDecodeError
from . import packaged
from .base import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve(spec: str) -> str | Path:
    """A local folder ready for from_pretrained, or a hub id that is reachable."""
    if spec in packaged.SHIPPED:
        return packaged.pull(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SpecDecodeError(f"{path} has no config.json.", "Point --model at a transformers model folder.")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise SpecDecodeError(
                f"{path} is not a model: expected a .gguf file or a transformers folder.",
                "Pass a folder with config.json, a .gguf file, or a shipped name.",
            )
        return gguf_folder(path)
    if spec.endswith(".gguf") or spec.startswith((".", "/", "~")):
        raise SpecDecodeError(f"model file {spec} does not exist.", "Check the path.")
    if spec.count("/") == 1 and _hub_reachable():
        return spec
    raise SpecDecodeError(
        f"unknown model '{spec}': not a shipped name, a local folder or file"
        + (", and the model hub is unreachable." if spec.count("/") == 1 else "."),
        f"Use a shipped model ({', '.join(packaged.SHIPPED)}), a local folder or a .gguf file.",
    )


def gguf_folder(path: Path) -> Path:
    """Convert a .gguf file once (cached by name, size and modification time) into a transformers folder."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = packaged.cache_root() / "gguf" / f"{path.stem}-{key}"
    if not (out / "done").exists():
        from .convert import convert_gguf

        convert_gguf(path, out)
    return out


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_model(spec: str | CausalLM, dtype: str = "bfloat16") -> CausalLM:
    if isinstance(spec, CausalLM):
        return spec
    if dtype not in DTYPES:
        raise SpecDecodeError(f"unknown dtype '{dtype}'.", f"Choose one of: {', '.join(DTYPES)}.")
    source = resolve(spec)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .hf import HFModel

    hf_logging.disable_progress_bar()  # loading converted safetensors takes seconds; its bar is noise
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype], attn_implementation="sdpa")
    except Exception as exc:  # corrupt or incomplete files surface as many exception types
        raise SpecDecodeError(
            f"could not load model '{spec}' from {source}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            "If the files are damaged, pull the model again (`specdecode pull NAME --force`) or re-download them.",
        ) from None
    finally:
        hf_logging.enable_progress_bar()
    return HFModel(model, tokenizer, name=spec)
