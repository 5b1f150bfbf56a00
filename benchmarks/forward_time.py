"""Time of one target forward over q new rows after a 300-token context: median and fastest of many, for A/B
comparisons of the model code on a noisy machine (`specdecode cost` keeps the fastest of 3, enough to size drafts,
too few to compare two versions of the code).

    python benchmarks/forward_time.py --model gemma-3-270m --quant int4 --rows 1 4 --repeats 150

To compare two commits, run it in a checkout of each, alternating, several times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.models.base import prefill
from specdecode.models.loading import load_model
from specdecode.tune.machine import capability, context_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    model = load_model(args.model, quant=args.quant)
    context = context_ids(model.vocab_size)
    cache = model.new_cache(len(context) + max(args.rows))
    prefill(model, cache, context)
    cpu = capability()
    print(f"{args.model} ({args.quant}) on {cpu['model']}, {cpu['threads']} threads, {' '.join(cpu['flags'])}")
    for q in args.rows:
        ids, positions = torch.tensor(context[:q]), torch.arange(cache.length, cache.length + q)
        causal = torch.ones(q, q, dtype=torch.bool).tril()
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            model.forward(cache, ids, positions, causal)
            seconds.append(time.perf_counter() - start)
            cache.discard()
        print(f"{q} rows: median {statistics.median(seconds) * 1e3:.2f} ms, fastest {min(seconds) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
