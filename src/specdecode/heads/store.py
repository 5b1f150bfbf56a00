"""Heads on disk: our folder (config.json with a `specdecode_head` entry + model.safetensors), the trained heads'
cache (~/.cache/specdecode/heads/<target>/<kind>), and loading any supported layout by looking at the folder.

Layouts read by `load_head`: ours; the `speculators` format (config.json with `speculators_model_type`, see
speculators_format.py); and the original EAGLE layouts (SafeAILab/EAGLE: `fc`, `layers.0.*` for EAGLE-1,
`midlayer.*` plus `d2t`/`t2d` for EAGLE-3, in pytorch_model.bin or model.safetensors)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import SpecDecodeError
from ..files import cache_root
from . import build_head, head_kind
from .layer import HeadConfig

WEIGHTS = "model.safetensors"


def cache_dir(target_name: str, kind: str) -> Path:
    """Where `specdecode train KIND --model TARGET` leaves its head (and where drafters look for it)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "--", str(target_name)).strip("-")
    return cache_root() / "heads" / safe / kind


def save_head(head, folder: str | Path, extra: dict | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous() for name, tensor in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))
    config = {"specdecode_head": json.loads(head.config.to_json()), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def load_head(folder: str | Path, kind: str | None = None):
    """A head (eval mode, float32) from a folder in any supported layout; `kind` (if given): its kind, or the drafter
    that will run it, which must be the one its kind drafts with."""
    from . import speculators_format

    folder = Path(folder).expanduser()
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise SpecDecodeError(f"{folder} has no config.json: not a draft head folder.", "Point --draft-model at a head folder.")
    raw = json.loads(config_path.read_text())
    if "specdecode_head" in raw:
        config = HeadConfig.from_dict(raw["specdecode_head"])
        state = load_file(str(folder / WEIGHTS))
    elif "speculators_model_type" in raw:
        config, state = speculators_format.read_speculators(raw, read_weights(folder))
    else:
        config, state = speculators_format.read_original_eagle(raw, read_weights(folder))
    if kind is not None and not head_kind(config.kind).answers_to(kind):
        drafter = head_kind(config.kind).drafter
        raise SpecDecodeError(f"{folder} holds a {config.kind} head, which the {drafter} drafter runs, not {kind}.",
                              f"Use --drafter {drafter}.")
    head = build_head(config)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SpecDecodeError(
            f"{folder}: weights do not fit a {config.kind} head (missing {missing[:3]}, unexpected {unexpected[:3]}).",
            "Check that the folder holds a complete head.",
        )
    return head.float().eval()


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, or of pytorch_model.bin."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return {name: t for f in files for name, t in load_file(str(f)).items()}
    bin_file = folder / "pytorch_model.bin"
    if bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise SpecDecodeError(f"{folder} has no weights (*.safetensors or pytorch_model.bin).", "Check the folder.")


def find_head(target_name: str, kind: str) -> Path:
    folder = cache_dir(target_name, kind)
    if not (folder / "config.json").is_file():
        raise SpecDecodeError(
            f"no trained {kind} head for {target_name} (looked in {folder}).",
            f"Train one with `specdecode train {kind} --model {target_name}`, or pass --draft-model DIR.",
        )
    return folder
