"""The int4 linear-layer candidates on this machine, for the layers of one model (all of them, so the weights come
from memory as in a real forward): milliseconds per pass over every layer, by number of rows, and whether a row's
result depends on the other rows.

    python benchmarks/linear_kernels.py [--model-shape qwen1.5b] [--rows 1,2,4,8,16,32] [--candidates ...]

Candidates:
- specdecode-amx / -avx512 / -avx2 / -scalar: specdecode's kernels (int8 activations per row and block of 32, exact
  integer dot products, fixed-order sums; kernels/cpu.cpp), on each code path this CPU runs;
- torch-int4: torch's `_weight_int4pack_mm_for_cpu` (bfloat16 activations, weights de-quantized per row block);
- ort-int4: onnxruntime's MatMulNBits with accuracy_level=4 (int8 activations; `pip install onnxruntime onnx`).
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode import kernels
from specdecode.models.native.linear import GROUP, pack, quantize_int4
from specdecode.tune.machine import capability

SHAPES = {  # K x N per linear layer (q/k/v fused, o, gate/up fused, down) and the layer count
    "qwen1.5b": ([(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536)], 28),
    "qwen0.5b": ([(896, 1152), (896, 896), (896, 9728), (4864, 896)], 24),
}


def specdecode_candidate(isa: str):
    ops = kernels.Kernels(kernels.native().module, isa)

    def make(weight: torch.Tensor):
        packed = pack(weight, "int4")
        return lambda x: ops.quant_linear(x, packed, 4)

    return make


def torch_candidate(weight: torch.Tensor):
    codes, scales, mins = quantize_int4(weight)  # w = scale * code + min = (code - 8) * scale + (min + 8 scale)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    zeros = mins.float() + 8 * scales.float()
    scales_zeros = torch.stack([scales.float(), zeros], -1).transpose(0, 1).contiguous().bfloat16()  # [K/G, N, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, GROUP, scales_zeros)


def ort_candidate(weight: torch.Tensor):
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n, k = weight.shape
    codes, scales, mins = quantize_int4(weight)
    # MatMulNBits: w = (code - zero) * scale with integer zero points; round the min to one
    zero_points = (-mins.float() / scales.float()).round().clamp(0, 15).to(torch.uint8)  # [N, K/G]
    packed_codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(n, k // GROUP, GROUP // 2)
    packed_zeros = zero_points[:, 0::2] | (zero_points[:, 1::2] << 4) if zero_points.shape[1] % 2 == 0 else None
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])]
    inits = [
        helper.make_tensor("w", TensorProto.UINT8, packed_codes.shape, packed_codes.numpy().tobytes(), raw=True),
        helper.make_tensor("s", TensorProto.FLOAT, [n * (k // GROUP)], scales.float().numpy().tobytes(), raw=True),
        helper.make_tensor("z", TensorProto.UINT8, [packed_zeros.numel()], packed_zeros.numpy().tobytes(), raw=True),
    ]
    node = helper.make_node("MatMulNBits", ["x", "w", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=GROUP, accuracy_level=4)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"x": np.ascontiguousarray(x.numpy())})[0])


def candidates(names: list[str]):
    made = {}
    for name in names:
        if name.startswith("specdecode-"):
            isa = {"amx": "avx512-amx", "avx512": "avx512-vnni", "avx2": "avx2", "scalar": "scalar"}[
                name.split("-", 1)[1]]
            if kernels.native() is None or isa not in kernels.supported_isas():
                continue
            made[name] = specdecode_candidate(isa)
        elif name == "torch-int4":
            made[name] = torch_candidate
        elif name == "ort-int4":
            try:
                import onnxruntime  # noqa: F401
            except ImportError:
                print("ort-int4 skipped: pip install onnxruntime onnx")
                continue
            made[name] = ort_candidate
    return made


def passes(layers, shapes, rows: int, repeats: int) -> list[float]:
    inputs = {k: torch.randn(rows, k) for k, _ in shapes}
    for run, (k, _) in layers:  # warm-up
        run(inputs[k])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for run, (k, _) in layers:
            run(inputs[k])
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)


def rows_independent(make, k: int, n: int) -> bool:
    run = make(torch.randn(n, k) * 0.02)
    x = torch.randn(8, k)
    together = run(x)
    return all(torch.equal(together[i : i + 1], run(x[i : i + 1])) for i in range(8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen1.5b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--candidates", default="specdecode-amx,specdecode-avx512,specdecode-avx2,torch-int4,ort-int4")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    shapes, count = SHAPES[args.model_shape]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu flags: {' '.join(capability()['flags'])}")
    print(f"{args.model_shape}: {count} layers x {len(shapes)} linears; ms per pass (fastest of {args.repeats}, "
          "median in brackets) and x one row")
    print("| candidate | rows independent | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    torch.manual_seed(0)
    for name, make in candidates(args.candidates.split(",")).items():
        layers = [(make(torch.randn(n, k) * 0.02), (k, n)) for _ in range(count) for k, n in shapes]
        cells, one = [], None
        for m in rows:
            times = passes(layers, shapes, m, args.repeats)
            one = one or times[0]
            cells.append(f"{times[0]:.1f} [{times[len(times) // 2]:.1f}] {times[0] / one:.2f}x")
        independent = rows_independent(make, *shapes[0])
        print(f"| {name} | {'yes' if independent else 'no'} | " + " | ".join(cells) + " |", flush=True)
        del layers


if __name__ == "__main__":
    main()
