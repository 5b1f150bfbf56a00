"""What bounds self-speculation on a target: how often a prefix of its layers already predicts its next token, what
each part of a one-token forward costs, and how much of the greedy choice a frequency draft vocabulary covers.

    python benchmarks/self_spec_limits.py --model gemma-3-270m [--quant int4] [--conversations 20]

- logit lens: the target's final norm and LM head applied to the residual stream entering layer l (the drafting
  network of an untrained exit head at l), top-1 agreement with the full model, teacher-forced over held-out ShareGPT
  conversations (the last ones of the file, which training keeps apart; never Spec-Bench);
- cost: milliseconds of layers [0, l) for one new token after a 300-token context, of the LM head (1 and 4 rows,
  full and restricted to a draft vocabulary) and of a whole one-token forward (fastest-of-N means);
- coverage: the share of the target's greedy tokens that a frequency draft vocabulary of N tokens holds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdecode.drafters.vocabulary import VocabularyHead, frequent_tokens
from specdecode.heads.target import final_norm, hidden_states, lm_head
from specdecode.kernels import cpu_flags
from specdecode.models.base import Sublayers, prefill
from specdecode.models.loading import load_model
from specdecode.train.data import conversations, sharegpt_text
from specdecode.tune.machine import context_ids

VOCABS = (4096, 8192, 16384, 32768)


def lens_and_coverage(model, count: int, tokens: int) -> tuple[dict, dict]:
    n_layers = model.n_layers
    quarters = {n_layers // 4, n_layers // 2, 2 * n_layers // 3, 3 * n_layers // 4}
    layers = sorted(quarters | set(range(n_layers - 3, n_layers + 1)))
    vocabularies = {size: set(frequent_tokens(model, size).tolist()) for size in VOCABS}
    agree, covered, total = dict.fromkeys(layers, 0), dict.fromkeys(VOCABS, 0), 0
    for conversation in list(conversations(sharegpt_text()))[-2 * count : -count]:
        text = conversation.prompt + "\n" + conversation.answer
        ids = model.tokenizer.encode(text, add_special_tokens=False)[:tokens]
        states = hidden_states(model, ids, layers)  # [K, n, d]
        top = {layer: lm_head(model, final_norm(model, states[k])).argmax(-1) for k, layer in enumerate(layers)}
        greedy = top[n_layers]
        for layer in layers:
            agree[layer] += int((top[layer] == greedy).sum())
        for size, vocabulary in vocabularies.items():
            covered[size] += sum(token in vocabulary for token in greedy.tolist())
        total += len(ids)
    return ({layer: round(agree[layer] / total, 3) for layer in layers},
            {size: round(covered[size] / total, 3) for size in VOCABS})


def timed(run, repeats: int = 50) -> float:
    """Milliseconds per call: the fastest of 3 means over `repeats` calls."""
    run()
    means = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        means.append((time.perf_counter() - start) / repeats * 1e3)
    return round(min(means), 2)


def costs(model) -> dict:
    cache = model.new_cache(400)
    prefill(model, cache, context_ids(model.vocab_size))  # the cost curve's 300-token context
    hidden = torch.randn(1, model.embedding.shape[1])
    token, position = torch.tensor([5]), torch.tensor([300])

    def layers_upto(stop: int):
        def run():
            see_all = torch.ones(1, cache.pending + 1, dtype=torch.bool)
            model.forward_sublayers(cache, token, position, see_all, Sublayers(stop))
            cache.discard()
        return run

    def forward():
        model.forward(cache, token, position, torch.ones(1, 1, dtype=torch.bool))
        cache.discard()

    stops = sorted({3, model.n_layers // 2, model.n_layers - 1, model.n_layers})
    out = {f"layers [0,{stop})": timed(layers_upto(stop)) for stop in stops}
    out["lm_head 1 row"] = timed(lambda: model.lm_head(hidden))
    out["lm_head 4 rows"] = timed(lambda: model.lm_head(hidden.repeat(4, 1)))
    for size in (8192, 32768):
        head = VocabularyHead.of(model.lm_head, frequent_tokens(model, size), model.vocab_size)
        out[f"lm_head {size} tokens 1 row"] = timed(lambda head=head: head(hidden))
    out["one-token forward"] = timed(forward)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    model = load_model(args.model, quant=args.quant)
    lens, coverage = lens_and_coverage(model, args.conversations, args.tokens)
    print(json.dumps({
        "model": args.model, "quant": args.quant, "threads": torch.get_num_threads(),
        "cpu_flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"}),
        "logit_lens_top1_agreement": lens, "draft_vocabulary_coverage": coverage, "ms": costs(model),
    }, indent=1))


if __name__ == "__main__":
    main()
