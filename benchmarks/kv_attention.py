"""Attention alone per KV cache format: tree_attention over a long context for a few verification widths and a
prompt chunk, each layer's keys and values distinct (so that a one-row step streams them from memory, as a real
forward does), the formats (and optionally other kernel builds) alternated round by round in one process.

    python benchmarks/kv_attention.py [--formats f32 bf16 int8] [--builds BUILD_ID ...] [--isas ISA ...] [--rounds 5]
        [--quick]

--builds: kernel builds under ~/.cache/specdecode/kernels/ to compare with this checkout's, in each format (builds
with the same ISA codes). --isas: other code paths of this build (e.g. avx512-vnni beside avx512-bf16).
Model shape: Qwen2.5-1.5B (12 query heads, 2 KV heads, head_dim 128). Prints ms per layer (median, min)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdecode import kernels
from specdecode.allocator import keep_freed_memory
from specdecode.cache.kv import KV_DTYPES

HQ, HKV, D, SCALE = 12, 2, 128, 128**-0.5
CASES = [(7680, 1, 28), (7680, 4, 28), (16384, 1, 28), (16384, 4, 28), (7680, 16, 8), (4096, 512, 1)]
DECODE_ROWS = (1, 4)  # --quick: only the decode-step cases


def cache(x: torch.Tensor, fmt: str, native) -> torch.Tensor:
    dtype = KV_DTYPES[fmt]
    return native.quantize_entries(x) if dtype == torch.int8 else x.to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["f32", "bf16", "int8"], choices=list(KV_DTYPES))
    parser.add_argument("--builds", nargs="*", default=[])
    parser.add_argument("--isas", nargs="*", default=[], choices=kernels.supported_isas())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="only 1 and 4 rows (decode and verification steps)")
    args = parser.parse_args()
    keep_freed_memory()
    native = kernels.native()
    root = Path.home() / ".cache/specdecode/kernels"
    runs = {fmt: (native, fmt) for fmt in args.formats}
    for build in args.builds:
        module = kernels.import_built(root / build / f"specdecode_cpu_{build}.so")
        runs.update({f"{fmt}@{build}": (kernels.Kernels(module, native.isa), fmt) for fmt in args.formats})
    for isa in args.isas:
        runs.update({f"{fmt}@{isa}": (kernels.Kernels(native.module, isa), fmt) for fmt in args.formats})
    print(f"isa {native.isa}, threads {torch.get_num_threads()}, kernels {kernels.build_id()}")
    for ctx, rows, n_layers in [case for case in CASES if not args.quick or case[1] in DECODE_ROWS]:
        n = ctx + rows
        mask = torch.ones(1, rows, n, dtype=torch.bool)
        mask[0, :, ctx:] = torch.ones(rows, rows, dtype=torch.bool).tril()
        queries = torch.randn(1, HQ, rows, D)
        raw = [(torch.randn(1, HKV, n, D), torch.randn(1, HKV, n, D)) for _ in range(n_layers)]
        layers = {fmt: [(cache(k, fmt, native), cache(v, fmt, native)) for k, v in raw] for fmt in set(args.formats) | {"f32"}}
        del raw
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (ops, fmt) in runs.items():
                start = time.perf_counter()
                for keys, values in layers[fmt]:
                    ops.tree_attention(queries, keys, values, mask, n, SCALE)
                times[name].append((time.perf_counter() - start) / n_layers * 1e3)
        cells = "  ".join(f"{name} {statistics.median(t):.2f} ({min(t):.2f})" for name, t in times.items())
        print(f"context {ctx}, {rows} rows, {n_layers} layers' KV: {cells}", flush=True)


if __name__ == "__main__":
    main()
