"""Two builds of specdecode's CPU kernels (cpu.cpp) side by side in one process, on a real model's forward: the
target's forward over q new tokens after 300 tokens of context, the builds alternated round by round so that the
host's drift (minutes of 20-50% on shared 2-core machines) falls on both alike. For kernel changes: build the old
and new source once each (their .so files under ~/.cache/specdecode/kernels/<build id>/), then

    SPECDECODE_ISA=avx2 python benchmarks/kernel_builds.py --model qwen2.5-coder-1.5b-instruct OLD.so NEW.so

Prints, per build, the median and the fastest forward per row count, with the ratio to one row.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from specdecode.kernels import cpu_flags, cpu_model, import_built
from specdecode.models.base import prefill
from specdecode.models.loading import load_model
from specdecode.tune.machine import context_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--rows", default="1,4,8,32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("builds", nargs="+", help="compiled extension files (.so)")
    args = parser.parse_args()
    rows = [int(part) for part in args.rows.split(",")]
    target = load_model(args.model, quant=args.quant)
    kernels = [dataclasses.replace(target.ops.kernels, module=import_built(Path(path))) for path in args.builds]
    context = context_ids(target.vocab_size)
    cache = target.new_cache(len(context) + max(rows))
    prefill(target, cache, context)
    seconds: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for q in rows:
            ids, positions = torch.tensor(context[:q]), torch.arange(len(context), len(context) + q)
            causal = torch.ones(q, q, dtype=torch.bool).tril()
            for build, kernel in enumerate(kernels):
                target.ops.kernels = kernel
                for repeat in range(4):  # the first warms the build's code and caches up
                    start = time.perf_counter()
                    target.forward(cache, ids, positions, causal)
                    cache.discard()
                    if repeat:
                        seconds.setdefault((build, q), []).append(time.perf_counter() - start)
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx"))))
    print(f"cpu: {cpu_model()}, flags: {flags}; kernel path {kernels[0].isa}; {args.model} {args.quant}")
    for build, path in enumerate(args.builds):
        for name, pick in (("median", statistics.median), ("fastest", min)):
            one = pick(seconds[(build, rows[0])])
            cells = ", ".join(f"{q} rows {pick(seconds[(build, q)]) * 1e3:.1f} ms ({pick(seconds[(build, q)]) / one:.2f}x)"
                              for q in rows)
            print(f"{Path(path).name} {name}: {cells}")


if __name__ == "__main__":
    main()
