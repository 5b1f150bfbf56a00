"""This CPU's ceilings for verifying drafted tokens on int4 weights: how fast it streams memory, how many int8
multiply-adds it can do at most, how many specdecode's linear kernel does by number of rows, and from these the
row count where a forward turns from memory-bound to compute-bound (beyond it every verified row costs compute).

    python benchmarks/roofline.py [--model-shape qwen1.5b] [--rows 1,2,4,8,16]

- peak: the widest integer dot-product instruction this CPU has (AVX-512 VNNI `vpdpbusd` zmm: 64 multiply-adds,
  or AVX2 `vpmaddubsw` ymm: 32), issued back to back on independent registers on every thread: no kernel does
  more multiply-adds a second;
- stream: reading a 1 GiB buffer with vector loads on every thread;
- kernel: specdecode's int4 x int8 linear layer (kernels/cpu.cpp) over the model shape's layers (the weights from
  memory, as in a forward) and over one layer read again and again (from cache), in multiply-adds a second.

Each number is the fastest of --repeats; the host's speed may drift between lines, so read ratios within a line.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

from specdecode import kernels
from specdecode.models.native.linear import pack
from specdecode.tune.machine import capability

from linear_kernels import SHAPES  # benchmarks/linear_kernels.py: the layer shapes of each model

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <vector>

// Independent accumulators: enough chains to cover the instruction's latency on every port that runs it.
#define TEN(op) op(a0) op(a1) op(a2) op(a3) op(a4) op(a5) op(a6) op(a7) op(a8) op(a9)

__attribute__((target("avx512f,avx512vnni")))
int64_t dpbusd_zmm(int64_t iters) {  // 64 multiply-adds per instruction
  __m512i a0 = _mm512_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0;
  const __m512i w = _mm512_set1_epi32(0x01020304), x = _mm512_set1_epi32(0x05060708);
#define DP(a) asm volatile("vpdpbusd %[w], %[x], %[acc]" : [acc] "+v"(a) : [w] "v"(w), [x] "v"(x));
  for (int64_t i = 0; i < iters; ++i) { TEN(DP) }
  return _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a9));
}

__attribute__((target("avx2")))
int64_t maddubs_ymm(int64_t iters) {  // 32 multiply-adds per instruction (pairs summed into int16)
  __m256i a0 = _mm256_set1_epi16(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0;
  const __m256i w = _mm256_set1_epi32(0x01020304);
#define MB(a) asm volatile("vpmaddubsw %[w], %[acc], %[acc]" : [acc] "+x"(a) : [w] "x"(w));
  for (int64_t i = 0; i < iters; ++i) { TEN(MB) }
  return _mm256_extract_epi16(_mm256_add_epi16(a0, a9), 0);
}

// Instructions a second over every thread: one chunk of `iters` x 10 instructions per thread.
double peak(bool vnni, int64_t iters) {
  const int threads = at::get_num_threads();
  std::vector<int64_t> sink(threads);
  auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sink[t] = vnni ? dpbusd_zmm(iters) : maddubs_ymm(iters);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 10.0 * iters * threads / seconds;
}

__attribute__((target("avx2")))
int64_t xor_lines(const uint8_t* data, int64_t begin, int64_t end) {  // 128-byte chunks [begin, end)
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t c = begin; c < end; ++c) {
    const __m256i* p = reinterpret_cast<const __m256i*>(data + 128 * c);
    s0 = _mm256_xor_si256(s0, _mm256_loadu_si256(p));
    s1 = _mm256_xor_si256(s1, _mm256_loadu_si256(p + 1));
    s2 = _mm256_xor_si256(s2, _mm256_loadu_si256(p + 2));
    s3 = _mm256_xor_si256(s3, _mm256_loadu_si256(p + 3));
  }
  return _mm256_extract_epi64(_mm256_xor_si256(_mm256_xor_si256(s0, s1), _mm256_xor_si256(s2, s3)), 0);
}

int64_t stream(torch::Tensor buffer) {  // reads every byte once with 32-byte loads, over all threads
  const uint8_t* data = buffer.data_ptr<uint8_t>();
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, buffer.numel() / 128, 4096,
                   [&](int64_t begin, int64_t end) { sink += xor_lines(data, begin, end); });
  return sink;
}
"""


def fastest(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen1.5b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    native = kernels.native()
    if native is None:
        raise SystemExit(f"specdecode's kernels are not built here: {kernels.status()}")
    vnni = native.isa.startswith("avx512")
    print(f"cpu: {kernels.cpu_model()}, {torch.get_num_threads()} threads, flags: {' '.join(capability()['flags'])}; "
          f"kernel path {native.isa}")

    probe = load_inline("specdecode_roofline", cpp_sources=SOURCE, functions=["peak", "stream"],
                        extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    instruction, macs = ("vpdpbusd zmm", 64) if vnni else ("vpmaddubsw ymm", 32)
    rate = max(probe.peak(vnni, 20_000_000) for _ in range(args.repeats))
    print(f"peak: {instruction} {rate / 1e9:.2f} G/s = {rate * macs / 1e9:.0f} G multiply-adds/s")
    buffer = torch.ones(1 << 30, dtype=torch.uint8)
    bandwidth = buffer.numel() / fastest(lambda: probe.stream(buffer), args.repeats)
    print(f"stream: {bandwidth / 1e9:.1f} GB/s reading 1 GiB")
    del buffer

    torch.manual_seed(0)
    shapes, count = SHAPES[args.model_shape]
    layers = [(pack(torch.randn(n, k) * 0.02, "int4"), k, n) for _ in range(count) for k, n in shapes]
    weight_bytes = sum(packed.numel() for packed, _, _ in layers)
    layer_macs = sum(k * n for _, k, n in layers)
    hot = pack(torch.randn(1536, 1536) * 0.02, "int4")
    print(f"kernel, {args.model_shape} layers ({weight_bytes / 1e6:.0f} MB int4) from memory, and one 1536x1536 "
          "layer read 60 times (from cache):")
    print("| rows | from memory ms | x one row | G multiply-adds/s | GB/s | from cache G multiply-adds/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    one = None
    for m in rows:
        inputs = {k: torch.randn(m, k) for _, k, _ in layers}
        seconds = fastest(lambda: [native.quant_linear(inputs[k], packed, 4) for packed, k, _ in layers], args.repeats)
        x = torch.randn(m, 1536)
        cached = fastest(lambda: [native.quant_linear(x, hot, 4) for _ in range(60)], args.repeats)
        one = one or seconds
        print(f"| {m} | {seconds * 1e3:.1f} | {seconds / one:.2f} | {m * layer_macs / seconds / 1e9:.0f} | "
              f"{weight_bytes / seconds / 1e9:.1f} | {m * 60 * 1536 * 1536 / cached / 1e9:.0f} |", flush=True)
    balance = one * rate * macs / layer_macs
    print(f"balance: the one-row pass's time buys {balance:.1f} rows of multiply-adds at the peak rate; past that "
          "many rows a forward's linear layers are compute-bound even with a perfect kernel")


if __name__ == "__main__":
    main()
