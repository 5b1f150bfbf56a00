"""Where a long prompt's forward spends its time: the linear layers (norm + matmul + bias + residual, one native call
each), attention (q/k norms, rotary, cache write and attention over the visible keys, one native call per layer),
and the rest (embedding, LM head of the last row, Python), for prompts of each length; and the multiply-add rate of
each part, against which `benchmarks/roofline.py` gives this CPU's peaks.

    python benchmarks/prefill_split.py --model qwen2.5-coder-1.5b-instruct --quant int4 --lengths 2048 8192 16384

Multiply-adds counted: linear layers 2 * params-per-row (one MAC each) per row, attention Hq * D * 2 per visible key
per row (scores and the weighted sum of values), causal. One prefill per length and round (a prompt's forward is
long enough to time once); `--kv-cache` picks the cache format, `--arithmetic` the linear layers' (the prompt's,
decoding's); `--builds` adds kernel builds under ~/.cache/specdecode/kernels/ (an earlier cpu.cpp), alternated with
this checkout's in each round, so that a machine whose speed drifts compares them fairly.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode import kernels
from specdecode.allocator import keep_freed_memory
from specdecode.models.base import prefill
from specdecode.models.loading import load_model
from specdecode.tune.machine import capability, context_ids


class Timed:
    """The model's kernels with the time of every fused_linear and attention_step call added up."""

    def __init__(self, kernels):
        self.kernels, self.seconds = kernels, {"linear": 0.0, "attention": 0.0}

    def __getattr__(self, name):
        return getattr(self.kernels, name)

    def _timed(self, part, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.seconds[part] += time.perf_counter() - start
        return out

    def fused_linear(self, *args, **kwargs):
        return self._timed("linear", lambda: self.kernels.fused_linear(*args, **kwargs))

    def attention_step(self, *args, **kwargs):
        return self._timed("attention", lambda: self.kernels.attention_step(*args, **kwargs))


def linear_macs_per_row(model) -> int:
    """Multiply-adds of one row through every decoder layer's linear layers (the LM head runs for the last row)."""
    block = model.blocks[0]
    per_layer = sum(layer.out_features * layer.in_features for layer in (block.qkv, block.out, block.gate_up, block.down))
    return per_layer * model.n_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--kv-cache", default=None, help="KV cache format (default: the model's)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--arithmetic", nargs="+", choices=["prompt", "decode"], default=["prompt"],
                        help="the linear layers' arithmetic: the prompt's (bfloat16 tiles on AMX; what a prefill "
                             "runs) and/or decoding's (int8), each timed in turn")
    parser.add_argument("--builds", nargs="*", default=[], help="earlier kernel builds to alternate with this one")
    parser.add_argument("--isas", nargs="*", default=[], choices=kernels.supported_isas(),
                        help="other code paths of this build to alternate with the best one (e.g. avx512-vnni)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=str, help="append one JSON line per length to this file")
    args = parser.parse_args()
    keep_freed_memory()  # as the command line does
    extra = {} if args.kv_cache is None else {"kv_cache": args.kv_cache}
    model = load_model(args.model, quant=args.quant, **extra)
    native = model.ops.kernels
    root = Path.home() / ".cache/specdecode/kernels"
    builds = {kernels.build_id(): native}
    builds.update({f"{kernels.build_id()}@{isa}": kernels.Kernels(native.module, isa) for isa in args.isas})
    for build in args.builds:
        builds[build] = kernels.Kernels(kernels.import_built(root / build / f"specdecode_cpu_{build}.so"), native.isa)
    cpu = capability()
    print(f"{args.model} ({args.quant}) on {cpu['model']}, {cpu['threads']} threads, {' '.join(cpu['flags'])}; "
          f"kernels {native.isa}")
    heads = model.heads
    runs = [(n, r, a, b) for n in args.lengths for r in range(args.rounds) for a in args.arithmetic for b in builds]
    for n, _, arithmetic, build in runs:
        timed = model.ops.kernels = Timed(builds[build])
        cache = model.new_cache(n + 1)
        start = time.perf_counter()
        prefill(model, cache, context_ids(model.vocab_size, n), prompt=arithmetic == "prompt")
        total = time.perf_counter() - start
        linear, attention = timed.seconds["linear"], timed.seconds["attention"]
        linear_macs = linear_macs_per_row(model) * n
        attention_macs = model.n_layers * heads.queries * heads.dim * 2 * n * (n + 1) // 2
        record = {
            "tokens": n, "seconds": round(total, 2), "tokens_per_s": round(n / total, 1),
            "linear_s": round(linear, 2), "attention_s": round(attention, 2),
            "other_s": round(total - linear - attention, 2),
            "linear_gmacs_per_s": round(linear_macs / linear / 1e9, 1),
            "attention_gmacs_per_s": round(attention_macs / attention / 1e9, 1),
            "isa": builds[build].isa, "kv_cache": args.kv_cache or "default", "arithmetic": arithmetic, "build": build,
        }
        print(json.dumps(record), flush=True)
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps(record) + "\n")
        del cache
    model.ops.kernels = native

if __name__ == "__main__":
    main()
