"""The command-line arguments that say which model, drafter, weights and sampling to use, shared by every command
that decodes (cli.py) and by the servers started outside it (serve/soak.py), and the SpecDecoder they describe:
the cheap arguments are checked before any model loads."""

from __future__ import annotations

import argparse

from .cache.kv import KV_CACHES
from .errors import SpecDecodeError


def add_model_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    parser.add_argument(
        "--model", required=model_required, help="shipped name, transformers folder, .gguf file or hub id"
    )
    parser.add_argument("--drafter", default="none", help="drafting method (see `specdecode drafters`)")
    parser.add_argument("--draft-model", help="draft model for model-based drafters")
    parser.add_argument(
        "-o", "--drafter-option", action="append", default=[], metavar="KEY=VALUE",
        help="drafter option, e.g. -o depth=5 -o topk=2 (repeatable)",
    )
    parser.add_argument(
        "--no-governor", dest="governor", action="store_false",
        help="speculate at every step (default: run plain steps while speculation does not pay on this machine)",
    )
    add_weights_args(parser)


def add_approximate_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--approximate", metavar="specpc:DRAFT_MODEL[+keep=0.25]",
        help="NOT lossless: SpecPC prompt compression, for long prompts: the draft model (the target's family) reads "
        "the prompt and the target reads only the share `keep` of it that the draft's attention ranks highest, so "
        "the first token comes sooner; the answer is the target's answer to that shorter prompt, marked as such",
    )


def add_prefix_cache_arg(parser: argparse.ArgumentParser) -> None:
    from .api import DEFAULT_PREFIX_CACHE_MB

    parser.add_argument(
        "--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for earlier requests' KV, reused by prompts that begin with the same tokens (the next turn "
        "of a chat, a shared document or system prompt); least recently used first out; 0 = off",
    )


def check_prefix_cache_mb(args) -> None:
    if getattr(args, "prefix_cache_mb", 0) < 0:
        raise SpecDecodeError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}.", "Pass 0 to turn it off.")


def add_weights_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument(
        "--backend", default="auto", choices=["auto", "native", "hf"],
        help="native: our CPU model files (llama, qwen2); hf: transformers; auto: native where supported",
    )
    parser.add_argument(
        "--quant", default="auto", choices=["auto", "none", "int8", "int4"],
        help="weights of target and draft model. int8/int4 (native backend) run on the row-exact kernels: answers "
             "are bit-exact whatever the batch or the draft. none = --dtype weights on torch's kernels, whose "
             "rounding changes with the rows beside a row (speculative and batched answers can then differ from "
             "plain ones). auto (default): int8 where the native backend runs the model, else none",
    )
    parser.add_argument(
        "--draft-quant", choices=["auto", "none", "int8", "int4"],
        help="the draft model's own weights (default: --quant); only speed depends on it, never the output",
    )
    parser.add_argument(
        "--kv-cache", default="auto", choices=list(KV_CACHES),
        help="the KV cache's format with --quant int4/int8 (auto: float32; bf16 halves its memory and what a long "
             "context's decode step reads, int8 quarters them; both change the answers a little)",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--verification", choices=["block", "token"], default="block",
                        help="how a sampled chain is verified: block verification (default; accepts as many tokens as "
                             "any lossless rule can) or token by token. Both keep the target's distribution")


def sampling_kwargs(args) -> dict:
    from .sampling import SamplingParams

    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    verification=args.verification)
    SamplingParams(**sampling)  # validate before loading models
    return sampling


def decoder_from_args(args):
    """Validate the cheap arguments first, then load the target (and draft) model behind a SpecDecoder. Commands
    without --prefix-cache-mb (generate: one prompt, whose --compare/--repeats timings a cache would distort) get
    none."""
    from .api import SpecDecoder
    from .approximate import parse_approximation
    from .drafters.base import parse_options
    from .drafters.building import check_drafter_name

    options = parse_options(args.drafter_option)
    check_drafter_name(args.drafter)  # before the slow model load
    check_prefix_cache_mb(args)
    approximate = getattr(args, "approximate", None)
    if approximate:
        parse_approximation(approximate)
    return SpecDecoder(
        args.model, args.drafter, args.draft_model, args.dtype, backend=args.backend, quant=args.quant,
        draft_quant=args.draft_quant, governor=args.governor, prefix_cache_mb=getattr(args, "prefix_cache_mb", 0),
        kv_cache=args.kv_cache, approximate=approximate,
        **options
    )
