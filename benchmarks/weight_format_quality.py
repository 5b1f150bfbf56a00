"""What a weight format costs in quality and what it gives in speed and exactness: held-out ShareGPT conversations
(the last ones of the file, which no `specdecode train` run reads; never Spec-Bench), each user turn and the
dataset's answer under the chat template, teacher-forced through the model with each weight format:

- perplexity of the answer tokens;
- top-1 agreement: the share of answer positions where the format's greedy next token is float32's;
- batch invariance: the same rows forwarded alone and beside other rows (a prompt chunked differently, the way a
  draft tree or a server batch puts rows side by side) give the same logits bit for bit, or not;
- plain greedy decode speed on a short prompt.

    python benchmarks/weight_format_quality.py --model smollm2-135m-instruct --conversations 16
    python benchmarks/weight_format_quality.py --model qwen2.5-coder-1.5b-instruct --conversations 12

It picks the CPU default weight format (README, `--quant auto`) from measurements, not from folklore.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from specdecode.allocator import keep_freed_memory
from specdecode.data.sharegpt import sharegpt_text, split
from specdecode.drafters import build_drafter
from specdecode.engine import generate
from specdecode.models.loading import load_model
from specdecode.sampling import SamplingParams
from specdecode.text import prompt_ids
from specdecode.tune.machine import capability

FORMATS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "int8": ("bfloat16", "int8"),
           "int4": ("bfloat16", "int4")}
SPEED_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."


def examples(tokenizer, count: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """(ids of prompt + answer cut at max_tokens, the index of the first answer token) per held-out conversation."""
    _, held_out = split(sharegpt_text(), 0, count)
    out = []
    for conversation in held_out:
        user = [{"role": "user", "content": conversation.prompt}]
        prompt = prompt_ids(tokenizer, user)
        full = prompt_ids(tokenizer, user + [{"role": "assistant", "content": conversation.answer}])
        if len(prompt) + 8 < min(len(full), max_tokens):
            out.append((full[:max_tokens], len(prompt)))
    return out


@torch.inference_mode()
def forced_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """[len(ids) - 1, V] float32 logits of every next token, the rows forwarded `chunk` at a time."""
    cache = model.new_cache(len(ids))
    rows = []
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        rows.append(model.forward(cache, torch.tensor(ids[start:end]), torch.arange(start, end), causal).float())
        cache.commit_all()  # the next chunk sees these rows as context
    return torch.cat(rows)


def measure(model, data: list[tuple[list[int], int]], reference: list[torch.Tensor] | None) -> dict:
    nll, count, agree, invariant = 0.0, 0, 0, True
    choices = []
    for i, (ids, answer_start) in enumerate(data):
        logits = forced_logits(model, ids, chunk=len(ids))  # [T - 1, V]: every row in one forward
        targets = torch.tensor(ids[answer_start:])  # [A]
        answer_logits = logits[answer_start - 1:]  # [A, V]: the rows that predict the answer tokens
        nll += float(torch.nn.functional.cross_entropy(answer_logits, targets, reduction="sum"))
        count += len(targets)
        chosen = answer_logits.argmax(-1)  # [A]
        choices.append(chosen)
        if reference is not None:
            agree += int((chosen == reference[i]).sum())
        if i < 2:  # the same rows in chunks of 7 (other rows beside them): bit-identical logits or not
            invariant &= torch.equal(logits, forced_logits(model, ids, chunk=7))
    return {"perplexity": math.exp(nll / count), "answer_tokens": count, "choices": choices,
            "agreement_with_float32": agree / count if reference is not None else None, "batch_invariant": invariant}


def decode_speed(model, tokens: int) -> float:
    ids = prompt_ids(model.tokenizer, [{"role": "user", "content": SPEED_PROMPT}])
    drafter = build_drafter("none", model)
    generate(model, drafter, ids, 8, SamplingParams())  # warm-up
    start = time.perf_counter()
    out, stats = generate(model, drafter, ids, tokens, SamplingParams())
    return (len(out) - 1) / (time.perf_counter() - start - stats.prefill_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=320, help="prompt + answer tokens per conversation")
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    keep_freed_memory()
    torch.manual_seed(0)
    cpu = capability()
    print(f"# {args.model} on {cpu['model']}, {cpu['threads']} threads, {' '.join(cpu['flags'])}")
    reference, data = None, None
    for name in args.formats:
        dtype, quant = FORMATS[name]
        model = load_model(args.model, dtype, quant=quant)
        if data is None:  # every format has the model's tokenizer: the same token ids
            data = examples(model.tokenizer, args.conversations, args.max_tokens)
        result = measure(model, data, reference)
        if name == "float32":
            reference = result["choices"]
        result.pop("choices")
        result["decode_tokens_per_s"] = decode_speed(model, args.decode_tokens)
        print(json.dumps({"format": name, "dtype": dtype, "quant": quant, "conversations": len(data),
                          **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}}), flush=True)
        del model


if __name__ == "__main__":
    main()
