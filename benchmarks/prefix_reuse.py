"""A second question about the same long document: its time to first token with the prefix cache against the first
question's (a full prefill), and whether its answer equals the one a fresh prefill gives.

    python benchmarks/prefix_reuse.py --model qwen2.5-coder-1.5b-instruct --quant int4 --length 8k

The document is the long suite's `doc-qa` question of that length (CPython's standard library, built on this
machine); the second question asks about the same text. Both under the chat template, one user turn each.
"""

from __future__ import annotations

import argparse
import json

from specdecode.allocator import keep_freed_memory
from specdecode.api import SpecDecoder
from specdecode.bench import long_suite
from specdecode.tune.machine import capability

SECOND = "\n\nList the names of every class defined in the code above, one per line."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--kv-cache", default="auto")
    parser.add_argument("--length", default="8k")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    keep_freed_memory()
    cpu = capability()
    print(f"{args.model} ({args.quant}, kv {args.kv_cache}) on {cpu['model']}, {cpu['threads']} threads, "
          f"{' '.join(cpu['flags'])}")
    decoder = SpecDecoder(args.model, quant=args.quant, kv_cache=args.kv_cache)
    question = next(q for q in long_suite.load_or_build(decoder.target.tokenizer, args.model, [args.length])
                    if q["category"] == "doc-qa")
    document_and_question = question["turns"][0]
    cut = document_and_question.rfind("\n\n")  # the document, then the question after the last blank line
    second = document_and_question[:cut] + SECOND
    first = decoder.generate([{"role": "user", "content": document_and_question}], args.max_new_tokens, chat=True)
    reused = decoder.generate([{"role": "user", "content": second}], args.max_new_tokens, chat=True)
    fresh = SpecDecoder(decoder.target, prefix_cache_mb=0).generate([{"role": "user", "content": second}],
                                                                    args.max_new_tokens, chat=True)
    record = {
        "length": args.length, "kv_cache": args.kv_cache,
        "first_question": {"prompt_tokens": first.stats.prompt_tokens, "ttft_s": round(first.stats.prefill_seconds, 2)},
        "second_question": {"reused_prompt_tokens": reused.stats.reused_prompt_tokens,
                            "ttft_s": round(reused.stats.prefill_seconds, 2),
                            "fresh_ttft_s": round(fresh.stats.prefill_seconds, 2)},
        "ttft_ratio_first_over_second": round(first.stats.prefill_seconds / reused.stats.prefill_seconds, 1),
        "second_identical_to_fresh_prefill": reused.token_ids == fresh.token_ids,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
