"""What a smaller KV cache costs in answers: greedy decoding of the long suite's questions (first turns) with each
KV format, compared token by token with the float32 cache (identical answers, and where the first difference is),
and teacher-forced: the share of the first format's answer tokens that each format's model, reading that answer,
predicts as its own greedy next token (a divergence early in an answer makes the rest of it differ; this counts
every position).

    python benchmarks/kv_format_agreement.py --model qwen2.5-coder-1.5b-instruct --quant int4 --lengths 2k \\
        --formats f32 bf16 --max-new-tokens 96

Each format loads the model once; the questions are the ones `specdecode bench --suite long` builds on this machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdecode.allocator import keep_freed_memory
from specdecode.bench import long_suite
from specdecode.engine import generate
from specdecode.drafters import build_drafter
from specdecode.models.base import prefill
from specdecode.models.loading import load_model
from specdecode.sampling import SamplingParams
from specdecode.text import prompt_ids
from specdecode.tune.machine import capability


def answers(model_name: str, quant: str, kv_cache: str, questions: list[dict], max_new_tokens: int,
            reference: list[dict] | None) -> list[dict]:
    target = load_model(model_name, quant=quant, kv_cache=kv_cache)
    results = []
    for i, question in enumerate(questions):
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": question["turns"][0]}])
        start = time.perf_counter()
        tokens, stats = generate(target, build_drafter("none", target), ids, max_new_tokens, SamplingParams())
        result = {"id": question["question_id"], "group": question["category"], "prompt_tokens": len(ids),
                  "tokens": tokens, "seconds": time.perf_counter() - start, "prefill_seconds": stats.prefill_seconds}
        if reference is not None:
            result["forced_agreement"] = forced_agreement(target, ids, reference[i]["tokens"])
        results.append(result)
    return results


@torch.inference_mode()
def forced_agreement(target, prompt: list[int], answer: list[int]) -> float:
    """The share of `answer`'s tokens that are the target's greedy choice after the prompt and the answer before
    them."""
    cache = target.new_cache(len(prompt) + len(answer))
    first = prefill(target, cache, prompt)  # [V]
    positions = torch.arange(len(prompt), len(prompt) + len(answer) - 1)
    causal = torch.ones(len(answer) - 1, len(answer) - 1, dtype=torch.bool).tril()
    rest = target.forward(cache, torch.tensor(answer[:-1]), positions, causal)  # [len - 1, V]
    chosen = [int(first.argmax())] + rest.argmax(-1).tolist()
    return sum(a == b for a, b in zip(chosen, answer)) / len(answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--lengths", default="2k")
    parser.add_argument("--formats", nargs="+", default=["f32", "bf16"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    keep_freed_memory()
    cpu = capability()
    print(f"{args.model} ({args.quant}) on {cpu['model']}, {cpu['threads']} threads, {' '.join(cpu['flags'])}")
    tokenizer = load_model(args.model, quant=args.quant).tokenizer
    questions = long_suite.load_or_build(tokenizer, args.model, long_suite.parse_lengths(args.lengths))
    reference = answers(args.model, args.quant, args.formats[0], questions, args.max_new_tokens, None)
    by_format = {args.formats[0]: reference}
    for fmt in args.formats[1:]:
        by_format[fmt] = answers(args.model, args.quant, fmt, questions, args.max_new_tokens, reference)
    for fmt, results in by_format.items():
        same = 0
        for ref, got in zip(reference, results):
            first = next((i for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])) if a != b), None)
            same += first is None and len(ref["tokens"]) == len(got["tokens"])
            print(json.dumps({"format": fmt, "id": got["id"], "group": got["group"], "prompt_tokens": got["prompt_tokens"],
                              "identical": first is None, "first_difference": first,
                              "forced_agreement": round(got.get("forced_agreement", 1.0), 4),
                              "prefill_s": round(got["prefill_seconds"], 2),
                              "decode_tokens_per_s": round((len(got["tokens"]) - 1) /
                                                           (got["seconds"] - got["prefill_seconds"]), 2)}))
        forced = sum(r.get("forced_agreement", 1.0) for r in results) / len(results)
        print(f"{fmt}: {same}/{len(results)} answers identical to {args.formats[0]}'s; teacher-forced agreement "
              f"{forced:.2%}")


if __name__ == "__main__":
    main()
