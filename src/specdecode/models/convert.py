"""GGUF -> transformers folder with float32 safetensors, done once per file (de-quantizing takes tens of seconds)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import SpecDecodeError


SUPPORTED_ARCHITECTURES = ("qwen2", "llama", "gemma3")


def check_gguf(gguf_path: Path) -> str:
    """Read the header only; return the architecture or raise a clear error before any slow work starts."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(gguf_path).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except Exception as exc:  # truncated, not GGUF, or an unknown version
        raise SpecDecodeError(
            f"could not read GGUF file {gguf_path}: {type(exc).__name__}: {exc}",
            "Check that the file is complete (download it again) and is a GGUF model.",
        ) from None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SpecDecodeError(
            f"GGUF file {gguf_path} holds a '{arch}' model.",
            f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.",
        )
    return arch


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(gguf_path)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    steps = tqdm(total=3, desc=f"convert {gguf_path.name}", unit="step")
    try:
        kwargs = dict(gguf_file=gguf_path.name)
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        steps.update()
        steps.set_postfix_str("de-quantizing weights")
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
        steps.update()
    except Exception as exc:  # transformers/gguf raise many types for a corrupt or unsupported file
        steps.close()
        raise SpecDecodeError(
            f"could not read GGUF file {gguf_path}: {type(exc).__name__}: {exc}",
            f"Check that it is a complete GGUF file of a supported architecture ({', '.join(SUPPORTED_ARCHITECTURES)}).",
        ) from None
    steps.set_postfix_str("writing safetensors")
    tmp.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    (tmp / "done").write_text(str(gguf_path))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    steps.update()
    steps.close()
    return out_dir
