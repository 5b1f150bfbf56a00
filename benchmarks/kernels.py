"""Cost of one linear layer per weight format and number of rows, on this machine: where the packed int4/int8
kernels stop beating the dense (de-quantized) bfloat16 weights. Sets models/native/linear.py's PACKED_ROWS.

    python benchmarks/kernels.py [--shapes 1536x8960,8960x1536,...] [--rows 1,2,4,...]

Each timing cycles over enough distinct weight matrices (~256 MB) that weights come from memory, not cache,
as they do in a real forward pass.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.models.native.linear import Linear

QWEN_1_5B = "1536x2048,1536x1536,1536x17920,8960x1536,1536x151936"  # K x N: qkv, o, gate_up, down, lm head


def seconds_per_call(layers: list[Linear], rows: int, repeats: int) -> float:
    x = torch.randn(rows, layers[0].dense.shape[1], dtype=torch.bfloat16)
    for layer in layers:  # warm-up
        layer(x)
    start = time.perf_counter()
    for _ in range(repeats):
        for layer in layers:
            layer(x)
    return (time.perf_counter() - start) / (repeats * len(layers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=QWEN_1_5B, help="K x N per linear layer, comma-separated")
    parser.add_argument("--rows", default="1,2,4,6,8,12,16,24,32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call")
    print("| K x N | format | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        copies = max(2, int(256e6 // (2 * k * n)))
        weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
        for quant in ("none", "int8", "int4"):
            layers = [Linear.of(w, None, quant, torch.bfloat16) for w in weights]
            for layer in layers:
                if layer.packed is not None:
                    layer.packed_rows = 1 << 30  # time the packed kernel at every M
            times = [seconds_per_call(layers, m, args.repeats) * 1e3 for m in rows]
            print(f"| {shape} | {quant} | " + " | ".join(f"{t:.3f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
