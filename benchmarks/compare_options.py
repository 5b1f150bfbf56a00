"""Drafter configurations side by side on the shipped tuning prompts (never Spec-Bench): decode speed against plain
decoding of the same prompt in the same process (prefill left out), tau, and whether the output is plain
decoding's, for quick what-if questions before a full `specdecode bench`.

    python benchmarks/compare_options.py --model gemma-3-270m --quant int4 \
        '{"name": "kangaroo", "draft_model": "DIR"}' '{"name": "layerskip", "vocab": 32768, "governor": false}'

Each configuration is JSON: `name` (a drafter), `governor` (default true), `draft` (a draft model to load) or
`draft_model` (a trained head's folder), and the drafter's options (the suffix hybrid's `lookup` included).
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.resources import files

import torch

from specdecode.drafters.base import build_drafter
from specdecode.engine import generate
from specdecode.governor import Governor
from specdecode.models.loading import load_model
from specdecode.sampling import SamplingParams
from specdecode.text import prompt_ids
from specdecode.tune.machine import capability


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--every", type=int, default=2, help="every n-th tuning prompt")
    parser.add_argument("configs", nargs="+", help="JSON drafter configurations")
    args = parser.parse_args()
    target = load_model(args.model, quant=args.quant)
    lines = files("specdecode.data").joinpath("tune_prompts.jsonl").read_text().splitlines()
    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": json.loads(line)["prompt"]}])
               for line in lines[:: args.every]]
    configs = [{"name": "none"}] + [json.loads(config) for config in args.configs]
    drafters = {}

    def run(config: dict, ids: list[int]):
        key = json.dumps(config)
        if key not in drafters:
            options = {k: v for k, v in config.items() if k not in ("name", "governor", "draft", "draft_model")}
            draft_model = config.get("draft_model")  # a head's folder, or a draft model to load:
            if "draft" in config:
                draft_model = load_model(config["draft"], quant=args.quant)
            drafters[key] = build_drafter(config["name"], target, draft_model, **options)
        governed = config.get("governor", True) and config["name"] != "none"
        start = time.perf_counter()
        tokens, stats = generate(target, drafters[key], ids, args.max_new_tokens, SamplingParams(),
                                 governor=Governor() if governed else None)
        return tokens, time.perf_counter() - start - stats.prefill_seconds, stats

    run(configs[0], prompts[0])  # warm-up
    totals = {json.dumps(c): {"seconds": 0.0, "tokens": 0, "forwards": 0, "identical": 0} for c in configs}
    for ids in prompts:
        plain = None
        for config in configs:
            tokens, seconds, stats = run(config, ids)
            plain = tokens if plain is None else plain
            total = totals[json.dumps(config)]
            total["seconds"] += seconds
            total["tokens"] += len(tokens)
            total["forwards"] += stats.target_forwards
            total["identical"] += tokens == plain
    base = totals[json.dumps(configs[0])]
    print(f"{args.model} {args.quant}, {torch.get_num_threads()} threads, flags "
          f"{' '.join(capability()['flags'])}, "
          f"{len(prompts)} tuning prompts x {args.max_new_tokens} tokens")
    print("| configuration | decode speed vs plain | tau | identical |\n|---|---:|---:|---:|")
    for key, total in totals.items():
        speed = (total["tokens"] / total["seconds"]) / (base["tokens"] / base["seconds"])
        print(f"| `{key}` | {speed:.2f}x | {total['tokens'] / total['forwards']:.2f} | "
              f"{total['identical']}/{len(prompts)} |")


if __name__ == "__main__":
    main()
