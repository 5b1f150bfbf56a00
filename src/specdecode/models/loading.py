"""Resolve --model: a shipped name, a local transformers folder, a .gguf file, or a hub id."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..cache.kv import KV_CACHES
from ..errors import SpecDecodeError
from ..files import cache_root
from . import packaged
from .base import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --quant auto on the native backend. Quantized weights run on the row-exact kernels: a row's numbers do not depend
# on the rows beside it (a draft tree, a server batch), so speculative and batched answers are plain decoding's bit
# for bit. int8 (Q8_0-like) is the finer of the two quantized formats (its quality against float weights:
# benchmarks/weight_format_quality.py); float weights run on torch's kernels, whose rounding changes with the rows.
AUTO_QUANT = "int8"


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


def gguf_file(spec: str) -> Path:
    """The GGUF file behind --model, for runtimes that read GGUF themselves (llama.cpp): a shipped model's
    assembled file, or a .gguf path."""
    if spec in packaged.SHIPPED:
        packaged.pull(spec)
        path = packaged.model_dir(spec) / "model.gguf"
        if not path.is_file():
            raise SpecDecodeError(
                f"the GGUF file of {spec} is missing ({path}).", f"Run `specdecode pull {spec} --force`."
            )
        return path
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise SpecDecodeError(
        f"'{spec}' is not a GGUF model: llama.cpp reads .gguf files only.",
        f"Use a shipped model ({', '.join(packaged.SHIPPED)}) or a .gguf file for --model.",
    )


def gguf_folder(path: Path) -> Path:
    """Convert a .gguf file once (cached by name, size and modification time) into a transformers folder."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "gguf" / f"{path.stem}-{key}"
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


BACKENDS = ("auto", "native", "hf")


def load_model(spec: str | CausalLM, dtype: str = "bfloat16", backend: str = "auto", quant: str = "auto",
               kv_cache: str = "auto") -> CausalLM:
    """backend: native (our model files; --quant applies), hf (transformers), auto (native where the family has a
    native file and the weights are local, else hf). quant: none (weights in `dtype`), int8, int4, or auto:
    AUTO_QUANT where the native backend runs the model (bit-exact rows, so answers that do not depend on the batch
    or the draft), else none. kv_cache: the KV cache's format (cache/kv.py KV_CACHES)."""
    if isinstance(spec, CausalLM):
        return spec
    check_load_options(dtype, backend, quant, kv_cache)
    source = resolve(spec)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading converted safetensors takes seconds; its bar is noise
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = None
        if backend != "hf" and isinstance(source, Path):
            from . import native

            model = native.load(source, tokenizer, spec, DTYPES[dtype], AUTO_QUANT if quant == "auto" else quant)
        if model is None:
            _check_fallback(spec, backend, "none" if quant == "auto" else quant)
            model = _load_transformers(source, tokenizer, spec, dtype)
    except SpecDecodeError:
        raise
    except Exception as exc:  # corrupt or incomplete files surface as many exception types
        raise SpecDecodeError(
            f"could not load model '{spec}' from {source}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            "If the files are damaged, pull the model again (`specdecode pull NAME --force`) or re-download them.",
        ) from None
    finally:
        hf_logging.enable_progress_bar()
    model.use_kv_cache(kv_cache)
    return model


def check_load_options(dtype: str, backend: str, quant: str, kv_cache: str = "auto") -> None:
    from .native import QUANTS

    for what, value, choices in (("dtype", dtype, DTYPES), ("backend", backend, BACKENDS),
                                 ("quant", quant, ("auto", *QUANTS)), ("KV cache format", kv_cache, KV_CACHES)):
        if value not in choices:
            raise SpecDecodeError(f"unknown {what} '{value}'.", f"Choose one of: {', '.join(choices)}.")
    if backend == "hf" and quant not in ("none", "auto"):
        raise SpecDecodeError(f"--quant {quant} needs the native backend.", "Drop --backend hf, or drop --quant.")


def parse_weights(weights: str) -> tuple[str, str]:
    """'hf' | 'native' | 'native-int4' | 'auto-int8' -> (backend, quant), checked."""
    backend, _, quant = weights.partition("-")
    quant = quant or "none"
    check_load_options("float32", backend, quant)
    return backend, quant


def _check_fallback(spec: str, backend: str, quant: str) -> None:
    """The native backend was asked for (or quantized weights, which only it has) but cannot run this model."""
    if backend == "native" or quant != "none":
        raise SpecDecodeError(
            f"the native backend has no model file for '{spec}' (native families: llama, qwen2; local weights only).",
            "Use --backend hf (and no --quant) for this model.",
        )


def _load_transformers(source, tokenizer, name: str, dtype: str) -> CausalLM:
    from transformers import AutoModelForCausalLM

    from .hf import HFModel

    model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype], attn_implementation="sdpa")
    return HFModel(model, tokenizer, name=name)
