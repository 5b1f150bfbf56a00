"""The `train` and `export-head` commands (registered by cli.build_parser)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecDecodeError
from ..heads import HEAD_KINDS


def add_parsers(sub) -> None:
    train = sub.add_parser("train", help="train a draft head for a target on this machine: EAGLE, EAGLE-3, Medusa, or "
                           "the exit heads of the self-speculative Kangaroo and EESD")
    train.add_argument("kind", choices=sorted(HEAD_KINDS))
    train.add_argument("--model", required=True, help="the target: shipped name, transformers folder or .gguf file")
    train.add_argument("--out", type=Path, help="working folder (features, checkpoints, head); default in the cache")
    train.add_argument("--max-tokens", type=int, help="training tokens to extract (default: by model size)")
    train.add_argument("--epochs", type=int)
    train.add_argument("--hours", type=float, help="wall-clock limit of this run's training; rerun to continue")
    train.add_argument("--draft-vocab", type=int, help="eagle3, kangaroo, eesd: draft vocabulary size")
    train.add_argument("--exit-layer", type=int,
                       help="kangaroo, eesd: the target layer whose input the head reads (default: 1/6 of the depth)")
    train.add_argument("--ttt-steps", type=int, help="eagle3: training-time-test steps")
    train.add_argument("--intermediate-size", type=int,
                       help="eagle, eagle3, eesd: the head layer's MLP width (default: the target's; narrower trains "
                       "faster per token)")
    train.add_argument("--random-init", action="store_true",
                       help="eagle3: start the head's layer from random weights, not from the target's last layer")
    train.add_argument("--answer-tokens", type=int, help="answer length (regenerated, or the dataset's cut there)")
    train.add_argument("--regenerate", action="store_true",
                       help="train on answers the target regenerates (batched; slower), not on ShareGPT's")
    train.add_argument("--lr", type=float)
    train.add_argument("--device", default="cpu", help="where the head trains: cpu, cuda, cuda:1 ...")
    train.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="the target's dtype (auto: bfloat16 on a GPU or a CPU with native bfloat16, AVX512_BF16 or "
                       "AMX; float32 elsewhere, where bfloat16 is emulated and several times slower)")
    train.add_argument("--backend", choices=["hf", "native", "auto"],
                       help="target backend for regeneration and features (default hf: batched regeneration; "
                       "native with --quant)")
    train.add_argument("--quant", default="none", choices=["none", "int8", "int4"],
                       help="the target's weights for features and held-out tau (native backend): train on the "
                       "weights you verify with; on a CPU int4 also extracts faster than bfloat16")
    train.add_argument("--no-bf16", action="store_true",
                       help="train in float32 (default: bfloat16 autocast where bfloat16 is native, as for --dtype auto)")
    train.set_defaults(run=cmd_train)

    export = sub.add_parser("export-head", help="write a trained EAGLE-3 head in the speculators format (vLLM)")
    export.add_argument("--head", type=Path, help="a head folder (any supported layout)")
    export.add_argument("--model", help="or: the target whose cached head to export")
    export.add_argument("--kind", default="eagle3", choices=sorted(HEAD_KINDS))
    export.add_argument("--out", type=Path, required=True)
    export.set_defaults(run=cmd_export)


def cmd_train(args) -> int:
    import torch

    from ..heads import head_kind
    from ..heads.store import cache_dir
    from ..models.loading import load_model
    from ..files import cache_root
    from .trainer import scaled_budget, train

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecDecodeError(f"--device {args.device}: no CUDA device is available.", "Use --device cpu.")
    backend = args.backend or ("hf" if args.quant == "none" else "native")
    native_bf16 = bfloat16_is_native(args.device)
    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if native_bf16 else "float32"
    target = load_model(args.model, dtype, backend, args.quant)  # the target's forwards run on the CPU engine
    budget = scaled_budget(
        target, max_tokens=args.max_tokens, epochs=args.epochs, hours=args.hours, draft_vocab=args.draft_vocab,
        exit_layer=args.exit_layer,
        ttt_steps=args.ttt_steps, intermediate_size=args.intermediate_size, answer_tokens=args.answer_tokens, lr=args.lr,
        regenerate=True if args.regenerate else None, warm_start=False if args.random_init else None,
    )
    out = args.out or cache_root() / "training" / cache_dir(target.name, args.kind).relative_to(cache_root() / "heads")
    report = train(args.kind, target, out, budget, args.device, bf16=native_bf16 and not args.no_bf16)
    history = report["history"]
    print(json.dumps({"head": report["head"], "drafter": head_kind(args.kind).drafter, "finished": report["finished"],
                      "tokens": report["tokens"], "train_seconds": round(report["train_seconds"]), "history": history},
                     indent=2))
    return 0


def bfloat16_is_native(device: str) -> bool:
    """A GPU, or a CPU with AVX512_BF16 or AMX: bfloat16 arithmetic in hardware. Elsewhere torch emulates it, and
    both the target's forwards and the head's autocast steps run several times slower than in float32."""
    from ..kernels import bfloat16_native

    return device.startswith("cuda") or bfloat16_native()


def cmd_export(args) -> int:
    from ..heads.speculators_format import export_speculators
    from ..heads.store import find_head, load_head

    if (args.head is None) == (args.model is None):
        raise SpecDecodeError("give exactly one of --head DIR and --model NAME.", "e.g. --model smollm2-135m-instruct")
    folder = args.head or find_head(args.model, args.kind)
    print(export_speculators(load_head(folder), args.out))
    return 0


