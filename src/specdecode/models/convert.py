"""GGUF -> transformers folder with float32 safetensors, done once per file (de-quantizing takes tens of seconds)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import SpecDecodeError


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
            "Check that it is a complete GGUF file of a supported architecture (qwen2, llama, gemma3).",
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
