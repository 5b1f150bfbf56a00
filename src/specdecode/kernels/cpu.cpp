// specdecode's CPU kernels: quantized linear layers and tree attention whose every output row is computed exactly as
// it would be alone. Speculative verification scores N rows in one forward; plain decoding scores one. When each row's
// arithmetic does not depend on the other rows (same operations, same order), the N-row forward gives bit for bit what
// N one-row forwards give, and speculative decoding is token-identical to plain decoding in any weight format.
//
// Linear (weights int4 or int8, activations int8):
//   - activations are quantized per row and per block of 32 (symmetric, |q| <= 127: a row's own numbers only);
//   - integer dot products per block are exact in int32 (AMX tdpbsud/tdpbssd for 16 rows at a time where the CPU has
//     AMX, AVX-512 VNNI vpdpbusd, or AVX2 vpmaddubsw + vpmaddwd);
//   - each output column sums its blocks in block order with the same float operations in every code path
//     (vectorized across output columns, never across the reduction), so the scalar, AVX2 and AVX-512 paths agree
//     bit for bit, whatever the number of rows or threads.
// Weights are packed in tiles of 16 output columns; per tile and block of 32 inputs:
//   int4: 4 chunks of 64 bytes (chunk c: column j's bytes 4j..4j+3 hold inputs 4c..4c+3 in the low nibbles and
//         16+4c..16+4c+3 in the high nibbles), then 16 fp16 scales and 16 fp16 mins: w = scale * code + min.
//   int8: 8 chunks of 64 bytes (chunk c: column j's bytes hold inputs 4c..4c+3), then 16 fp16 scales: w = scale * code.
//
// Attention: each (query row, head) reduces over its visible keys in position order, with the same vector blocking
// whatever the other rows are; keys hidden by the tree mask are skipped, not zeroed.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int BLOCK = 32;   // inputs per quantization block
constexpr int TILE = 16;    // output columns per weight tile
constexpr int Q4_BYTES = 4 * 64 + 2 * TILE * 2;  // nibbles + scales + mins
constexpr int Q8_BYTES = 8 * 64 + TILE * 2;      // codes + scales
constexpr int PREFETCH = 12;  // blocks ahead into L1 (weights stream from memory once per forward)
constexpr int PREFETCH_L2 = 20 * 1024;  // bytes ahead into L2 as well, where the pass is memory-bound (few rows):
constexpr int FAR_ROWS_AVX512 = 4;       // up to this many rows a pass (AVX-512 VNNI)
constexpr int FAR_ROWS_AVX2 = 2;         // (AVX2: its int8 products cost twice the instructions)
constexpr int64_t ROW_BLOCK = 128;  // rows per pass over the weights (quant_linear)

enum Isa { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3, AMX = 4 };  // each has the ones below it (AMX: BF16 too)

// Requests a weight block's cache lines PREFETCH blocks ahead into L1 and, with `far`, PREFETCH_L2 bytes ahead into L2:
// with few rows a pass over the weights waits on memory, and the hardware prefetcher alone keeps too few lines in
// flight to stream at the machine's rate; with many rows it is compute-bound and the extra requests only cost issue
// slots.
template <int BYTES>
inline void prefetch_block(const uint8_t* blk, bool far) {
  for (int line = 0; line < BYTES; line += 64) _mm_prefetch(blk + PREFETCH * BYTES + line, _MM_HINT_T0);
  if (far)
    for (int line = 0; line < BYTES; line += 64) _mm_prefetch(blk + PREFETCH_L2 + line, _MM_HINT_T1);
}

// ---------------------------------------------------------------------------------------------------------------
// Activation quantization: per row, per block of 32, symmetric int8 with |q| <= 127.
// An array whose elements start uninitialized: every element is written before it is read, and zero-filling a
// prompt chunk's codes (megabytes per call) cost more than quantizing them.
template <typename T>
struct Uninit {
  std::unique_ptr<T[]> p;
  void resize(int64_t n) { p.reset(new T[n]); }
  T* data() { return p.get(); }
  const T* data() const { return p.get(); }
  T& operator[](int64_t i) { return p[i]; }
  const T& operator[](int64_t i) const { return p[i]; }
};

struct QuantRows {
  int64_t rows, blocks;
  Uninit<int8_t> codes;    // [rows, blocks * 32]
  Uninit<uint8_t> magnitudes;  // [rows, blocks * 32]: |code| (AVX2 int8 path)
  Uninit<float> scales;    // [rows, blocks]
  Uninit<int32_t> sums;    // [rows, blocks]: sum of codes
  Uninit<float> shifts;    // [rows, blocks]: scale * sum (what a block's weight min is multiplied by)
};

// Round to nearest even (the default MXCSR mode), as _mm256_cvtps_epi32 does.
inline int32_t round_even(float v) { return _mm_cvtss_si32(_mm_set_ss(v)); }

// Symmetric int8 codes of x[0..n): max|x| -> 127, rounded to nearest even; returns the scale max|x| / 127 and the
// codes' sum. Activation blocks, KV cache entries and the queries that meet them are all quantized by this.
float quantize_codes(const float* x, int64_t n, int8_t* codes, int32_t& sum) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t v = std::min(127, std::max(-127, round_even(x[i] * inverse)));
    codes[i] = static_cast<int8_t>(v);
    sum += v;
  }
  return amax / 127.f;
}

void quantize_block_scalar(const float* in, int8_t* codes, uint8_t* magnitudes, float& scale, int32_t& sum) {
  scale = quantize_codes(in, BLOCK, codes, sum);
  for (int i = 0; i < BLOCK; ++i) magnitudes[i] = static_cast<uint8_t>(std::abs(codes[i]));
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// The same numbers as quantize_block_scalar (max, one division, one multiply and a rounding per element).
void quantize_block_avx2(const float* in, int8_t* codes, uint8_t* magnitudes, float& scale, int32_t& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], amax = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    x[c] = _mm256_loadu_ps(in + 8 * c);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[c]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float top = _mm_cvtss_f32(m);
  const float inverse = top > 0.f ? 127.f / top : 0.f;
  scale = top / 127.f;
  const __m256 inv = _mm256_set1_ps(inverse);
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  __m256i q[4], total = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    q[c] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(x[c], inv))));
    total = _mm256_add_epi32(total, q[c]);
  }
  // int32 -> int8 in order: packs interleave 128-bit lanes, the permute restores the order
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
  const __m256i words2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
  const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words2), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), bytes);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(magnitudes), _mm256_abs_epi8(bytes));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  sum = _mm_cvtsi128_si32(t);
}
#pragma GCC pop_options

QuantRows quantize_rows(const float* x, int64_t rows, int64_t k, int64_t stride, int isa) {
  QuantRows q;
  q.rows = rows;
  q.blocks = k / BLOCK;
  q.codes.resize(rows * k);
  q.magnitudes.resize(rows * k);
  q.scales.resize(rows * q.blocks);
  q.sums.resize(rows * q.blocks);
  q.shifts.resize(rows * q.blocks);
  const auto block = isa >= AVX2 ? quantize_block_avx2 : quantize_block_scalar;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < q.blocks; ++b) {
        const int64_t i = r * q.blocks + b;
        block(x + r * stride + b * BLOCK, q.codes.data() + r * k + b * BLOCK, q.magnitudes.data() + r * k + b * BLOCK,
              q.scales[i], q.sums[i]);
        q.shifts[i] = q.scales[i] * static_cast<float>(q.sums[i]);
      }
  });
  return q;
}

// IEEE half -> float, exactly (as vcvtph2ps does), without needing F16C in the scalar path.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// The scalar reference: the same float operations as the vector paths, one column at a time.
void q4_tile_scalar(const uint8_t* tile, int64_t blocks, const QuantRows& a, int64_t r0, int64_t rows, float* y,
                    int64_t y_stride) {
  for (int64_t r = r0; r < r0 + rows; ++r) {
    const int8_t* codes = a.codes.data() + r * blocks * BLOCK;
    for (int j = 0; j < TILE; ++j) {
      float acc = 0.f, accm = 0.f;  // the dot products' and the mins' terms
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = tile + b * Q4_BYTES;
        int32_t dot = 0;
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = blk[64 * c + 4 * j + i];
            dot += (byte & 15) * codes[b * BLOCK + 4 * c + i] + (byte >> 4) * codes[b * BLOCK + 16 + 4 * c + i];
          }
        uint16_t s, m;
        std::memcpy(&s, blk + 256 + 2 * j, 2);
        std::memcpy(&m, blk + 288 + 2 * j, 2);
        const float sa = a.scales[r * blocks + b], shift = a.shifts[r * blocks + b];
        acc = std::fma(static_cast<float>(dot), half_to_float(s) * sa, acc);
        accm = std::fma(half_to_float(m), shift, accm);
      }
      y[(r - r0) * y_stride + j] = acc + accm;
    }
  }
}

void q8_tile_scalar(const uint8_t* tile, int64_t blocks, const QuantRows& a, int64_t r0, int64_t rows, float* y,
                    int64_t y_stride) {
  for (int64_t r = r0; r < r0 + rows; ++r) {
    const int8_t* codes = a.codes.data() + r * blocks * BLOCK;
    for (int j = 0; j < TILE; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = tile + b * Q8_BYTES;
        int32_t dot = 0;
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i)
            dot += static_cast<int8_t>(blk[64 * c + 4 * j + i]) * codes[b * BLOCK + 4 * c + i];
        uint16_t s;
        std::memcpy(&s, blk + 512 + 2 * j, 2);
        acc = std::fma(static_cast<float>(dot), half_to_float(s) * a.scales[r * blocks + b], acc);
      }
      y[(r - r0) * y_stride + j] = acc;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// The 4 bytes at p in every 32-bit lane, by a float broadcast from memory (a plain load) where `wide` (many rows: the
// kernels issue 8 a row and block, and the integer vpbroadcastd takes a vector-pipe uop on some cores), else by
// vpbroadcastd (measured faster with few rows).
template <bool wide>
inline __m256i broadcast4(const int8_t* p) {
  if (wide) return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// int4, 8 columns (half h of a tile), R rows at a time. The mins' terms (the same float operations in the same order
// as the other paths) join the block loop for up to 4 rows; from 5 rows on, a second set of R accumulators there
// spills AVX2's 16 registers, so a second pass over the tile adds them (32 bytes a block, read from cache).
template <int R>
void q4_half_avx2(const uint8_t* tile, int h, int64_t blocks, const QuantRows& a, int64_t r0, float* y,
                  int64_t y_stride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr bool mins_inline = R <= 4;
  __m256 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = tile + b * Q4_BYTES;
    if (h == 0) prefetch_block<Q4_BYTES>(blk, R <= FAR_ROWS_AVX2);
    __m256i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * h));
      lo[c] = _mm256_and_si256(v, low4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + 16 * h)));
    const __m256 mw = mins_inline ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * h)))
                                  : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* codes = a.codes.data() + (row * blocks + b) * BLOCK;
      __m256i part[4];  // int16 pair sums; each lane of their total holds 16 products, |sum| <= 16 * 15 * 127
      for (int c = 0; c < 4; ++c)
        part[c] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], broadcast4<!mins_inline>(codes + 4 * c)),
                                   _mm256_maddubs_epi16(hi[c], broadcast4<!mins_inline>(codes + 16 + 4 * c)));
      const __m256i pairs = _mm256_add_epi16(_mm256_add_epi16(part[0], part[1]), _mm256_add_epi16(part[2], part[3]));
      const __m256i dot = _mm256_madd_epi16(pairs, ones);
      const __m256 sa = _mm256_broadcast_ss(&a.scales[row * blocks + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, sa), acc[r]);
      if (mins_inline) accm[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(&a.shifts[row * blocks + b]), accm[r]);
    }
  }
  for (int64_t b = 0; !mins_inline && b < blocks; ++b) {
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + b * Q4_BYTES + 288 + 16 * h)));
    for (int r = 0; r < R; ++r)
      accm[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(&a.shifts[(r0 + r) * blocks + b]), accm[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * y_stride + 8 * h, _mm256_add_ps(acc[r], accm[r]));
}

// int8, 8 columns, R rows: |a| (u8) times sign(a) * w (s8), so no pair of products can saturate int16.
template <int R>
void q8_half_avx2(const uint8_t* tile, int h, int64_t blocks, const QuantRows& a, int64_t r0, float* y,
                  int64_t y_stride) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = tile + b * Q8_BYTES;
    if (h == 0) prefetch_block<Q8_BYTES>(blk, R <= FAR_ROWS_AVX2);
    __m256i w[8];
    for (int c = 0; c < 8; ++c) w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * h));
    const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 512 + 16 * h)));
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* codes = a.codes.data() + (row * blocks + b) * BLOCK;
      const int8_t* mags = reinterpret_cast<const int8_t*>(a.magnitudes.data()) + (row * blocks + b) * BLOCK;
      __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int c = 0; c < 8; ++c) {
        const __m256i signed_w = _mm256_sign_epi8(w[c], broadcast4<(R > 4)>(codes + 4 * c));
        const __m256i pairs = _mm256_maddubs_epi16(broadcast4<(R > 4)>(mags + 4 * c), signed_w);
        part[c % 2] = _mm256_add_epi32(part[c % 2], _mm256_madd_epi16(pairs, ones));
      }
      const __m256i dot = _mm256_add_epi32(part[0], part[1]);
      const __m256 sa = _mm256_broadcast_ss(&a.scales[row * blocks + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, sa), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * y_stride + 8 * h, acc[r]);
}

template <int R>
void tile_avx2(int bits, const uint8_t* tile, int64_t blocks, const QuantRows& a, int64_t r0, float* y,
               int64_t y_stride) {
  for (int h = 0; h < 2; ++h) {
    if (bits == 4)
      q4_half_avx2<R>(tile, h, blocks, a, r0, y, y_stride);
    else
      q8_half_avx2<R>(tile, h, blocks, a, r0, y, y_stride);
  }
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

// acc += u8 x s8 dot products of w with the 4 bytes at p broadcast to every lane, the broadcast done by the load
// (embedded broadcast): compilers emit a separate vpbroadcastd, which competes with vpdpbusd for the vector pipes.
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %[a]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [a] "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

template <int R>
void q4_tile_avx512(const uint8_t* tile, int64_t blocks, const QuantRows& a, int64_t r0, float* y,
                    int64_t y_stride) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  constexpr bool mins_inline = R <= 8;  // else the mins' terms in a second pass (as q4_half_avx2: registers)
  __m512 acc[R], accm[R];  // the dot products' and the mins' terms
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = tile + b * Q4_BYTES;
    prefetch_block<Q4_BYTES>(blk, R <= FAR_ROWS_AVX512);
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * c);
      lo[c] = _mm512_and_si512(v, low4);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    const __m512 mw = mins_inline ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)))
                                  : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* codes = a.codes.data() + (row * blocks + b) * BLOCK;
      // Integer sums: their order does not change the result. Two chains per row hide vpdpbusd's latency, whatever
      // the number of rows (one chain a row, from 4 rows on, left the vector pipes idle).
      __m512i part[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int c = 0; c < 4; ++c) {
        part[0] = dpbusd_bcast(part[0], lo[c], codes + 4 * c);
        part[1] = dpbusd_bcast(part[1], hi[c], codes + 16 + 4 * c);
      }
      const __m512i dot = _mm512_add_epi32(part[0], part[1]);
      const float sa = a.scales[row * blocks + b], shift = a.shifts[row * blocks + b];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, _mm512_set1_ps(sa)), acc[r]);
      if (mins_inline) accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(shift), accm[r]);
    }
  }
  for (int64_t b = 0; !mins_inline && b < blocks; ++b) {
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + b * Q4_BYTES + 288)));
    for (int r = 0; r < R; ++r) accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.shifts[(r0 + r) * blocks + b]), accm[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, _mm512_add_ps(acc[r], accm[r]));
}

// int8 with VNNI: (w + 128) as u8 times a, minus 128 * sum(a): exact, no saturation.
template <int R>
void q8_tile_avx512(const uint8_t* tile, int64_t blocks, const QuantRows& a, int64_t r0, float* y,
                    int64_t y_stride) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = tile + b * Q8_BYTES;
    prefetch_block<Q8_BYTES>(blk, R <= FAR_ROWS_AVX512);
    __m512i w[8];
    for (int c = 0; c < 8; ++c) w[c] = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * c), flip);
    const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 512)));
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* codes = a.codes.data() + (row * blocks + b) * BLOCK;
      __m512i part[2] = {_mm512_set1_epi32(-128 * a.sums[row * blocks + b]), _mm512_setzero_si512()};
      for (int c = 0; c < 8; ++c) part[c % 2] = dpbusd_bcast(part[c % 2], w[c], codes + 4 * c);  // as in q4
      const __m512i dot = _mm512_add_epi32(part[0], part[1]);
      const float sa = a.scales[row * blocks + b];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, _mm512_set1_ps(sa)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, acc[r]);
}

template <int R>
void tile_avx512(int bits, const uint8_t* tile, int64_t blocks, const QuantRows& a, int64_t r0, float* y,
                 int64_t y_stride) {
  if (bits == 4)
    q4_tile_avx512<R>(tile, blocks, a, r0, y, y_stride);
  else
    q8_tile_avx512<R>(tile, blocks, a, r0, y, y_stride);
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------------
// Row chunks: the widest kernel that fits the rows left; a row's arithmetic is the same in every width.
using TileFn = void (*)(int, const uint8_t*, int64_t, const QuantRows&, int64_t, float*, int64_t);

constexpr int MAX_ROWS_AVX512 = 16;
constexpr int MAX_ROWS_AVX2 = 8;

TileFn avx512_kernel(int rows) {
  static const TileFn table[] = {nullptr,         tile_avx512<1>,  tile_avx512<2>,  tile_avx512<3>,  tile_avx512<4>,
                                 tile_avx512<5>,  tile_avx512<6>,  tile_avx512<7>,  tile_avx512<8>,  tile_avx512<9>,
                                 tile_avx512<10>, tile_avx512<11>, tile_avx512<12>, tile_avx512<13>, tile_avx512<14>,
                                 tile_avx512<15>, tile_avx512<16>};
  return table[rows];
}

TileFn avx2_kernel(int rows) {
  static const TileFn table[] = {nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>,
                                 tile_avx2<5>, tile_avx2<6>, tile_avx2<7>, tile_avx2<8>};
  return table[rows];
}

// ---------------------------------------------------------------------------------------------------------------
// AMX (Intel Sapphire Rapids and later): one tile instruction gives the exact int32 dot products of 16 rows x 16
// columns x one block, which AVX-512 VNNI computes with 8 vpdpbusd a row. The float epilogue (scale, sum in block
// order, the int4 mins' terms) is q4_tile_avx512's / q8_tile_avx512's, operation for operation, so a row's numbers are
// those of every other path. Rows past the last full 16 take the AVX-512 kernel. Compilers without AMX's intrinsics
// (before GCC 11, clang 12) build the extension without this path.
#if !defined(SPECDECODE_AMX) && defined(__has_include)
#if __has_include(<amxtileintrin.h>) || __has_include(<amxintrin.h>)
#define SPECDECODE_AMX 1
#endif
#endif
#ifndef SPECDECODE_AMX
#define SPECDECODE_AMX 0
#endif

constexpr int AMX_ROWS = 16;   // rows a tile instruction takes
constexpr int AMX_MIN_ROWS = 32;  // fewer rows stay on AVX-512 VNNI: one tile of rows does not repay unpacking the
                                  // int4 weights for the tiles (measured slower at 16 rows)

#if SPECDECODE_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

constexpr int AMX_GROUP = 8;   // blocks whose dot products are staged before their float epilogue

// Linux lends a process the AMX register state only on request (once per process; later calls are no-ops).
bool amx_permitted() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return permitted;
}

// Tiles 0 and 3: dot products [16 rows, 16 int32]; 1 and 4: activation codes [16 rows, 32 int8]; 2 and 5: one
// block's weights [8, 64] in the layout tdpb* reads (row i: column j's inputs 4i..4i+3 in bytes 4j..4j+3), which is
// the packed int8 chunks as they are and the int4 chunks' low nibbles (rows 0-3) then high nibbles (rows 4-7). Two
// sets, alternated by block.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

TileConfig amx_config() {
  TileConfig config;
  for (int t : {0, 3}) config.rows[t] = AMX_ROWS, config.bytes_per_row[t] = 64;
  for (int t : {1, 4}) config.rows[t] = AMX_ROWS, config.bytes_per_row[t] = BLOCK;
  for (int t : {2, 5}) config.rows[t] = BLOCK / 4, config.bytes_per_row[t] = 64;
  return config;
}

// Loads a tile configuration where the thread's differs (loading it costs more than reading it): other libraries
// on the thread (oneDNN in torch), and attention's key dots below, configure tiles their own way.
void amx_load(const TileConfig& wanted) {
  TileConfig current;
  _tile_storeconfig(&current);
  if (std::memcmp(&current, &wanted, sizeof wanted) != 0) _tile_loadconfig(&wanted);
}

void amx_configure() {
  static const TileConfig wanted = amx_config();
  amx_load(wanted);
}

// One block's dot products into `dots` [16 rows, 16 int32], with tiles C, A, B (literal numbers: the intrinsics name
// their registers in the instruction text).
#define AMX_BLOCK_DOTS(C, A, B, signed_weights, codes, code_stride, weights, dots) \
  do {                                                                             \
    _tile_loadd(A, codes, code_stride);                                            \
    _tile_loadd(B, weights, 64);                                                   \
    _tile_zero(C);                                                                 \
    if (signed_weights)                                                            \
      _tile_dpbssd(C, A, B);                                                       \
    else                                                                           \
      _tile_dpbsud(C, A, B);                                                       \
    _tile_stored(C, dots, 64);                                                     \
  } while (0)

// Rows [row_begin, row_begin + 16 * chunks) of one weight tile (at most ROW_BLOCK rows).
void tile_rows_amx(int bits, const uint8_t* tile, int64_t blocks, const QuantRows& a, int64_t row_begin,
                   int64_t chunks, float* y, int64_t y_stride) {
  const int64_t bytes = bits == 4 ? Q4_BYTES : Q8_BYTES, scales_at = bits == 4 ? 256 : 512;
  const int64_t code_stride = blocks * BLOCK;
  alignas(64) float acc[ROW_BLOCK][TILE], accm[ROW_BLOCK][TILE];  // the dot products' and the mins' terms
  alignas(64) uint8_t unpacked[AMX_GROUP][BLOCK / 4 * 64];
  alignas(64) int32_t dots[AMX_GROUP][AMX_ROWS * TILE];
  alignas(64) float scales[AMX_GROUP][TILE], mins[AMX_GROUP][TILE];
  const uint8_t* weights[AMX_GROUP];
  const int64_t rows = chunks * AMX_ROWS;
  for (int64_t r = 0; r < rows; ++r) {
    _mm512_store_ps(acc[r], _mm512_setzero_ps());
    _mm512_store_ps(accm[r], _mm512_setzero_ps());
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  amx_configure();
  for (int64_t b0 = 0; b0 < blocks; b0 += AMX_GROUP) {
    const int n = static_cast<int>(std::min<int64_t>(AMX_GROUP, blocks - b0));
    for (int j = 0; j < n; ++j) {
      const uint8_t* blk = tile + (b0 + j) * bytes;
      weights[j] = blk;
      if (bits == 4) {
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(blk + 64 * c);
          _mm512_store_si512(unpacked[j] + 64 * c, _mm512_and_si512(v, low4));
          _mm512_store_si512(unpacked[j] + 64 * (4 + c), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
        }
        weights[j] = unpacked[j];
        _mm512_store_ps(mins[j], _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288))));
      }
      const __m256i half_scales = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + scales_at));
      _mm512_store_ps(scales[j], _mm512_cvtph_ps(half_scales));
    }
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t r0 = row_begin + chunk * AMX_ROWS;
      const int8_t* codes = a.codes.data() + (r0 * blocks + b0) * BLOCK;
      for (int j = 0; j < n; j += 2) {
        AMX_BLOCK_DOTS(0, 1, 2, bits == 8, codes + j * BLOCK, code_stride, weights[j], dots[j]);
        if (j + 1 < n)
          AMX_BLOCK_DOTS(3, 4, 5, bits == 8, codes + (j + 1) * BLOCK, code_stride, weights[j + 1], dots[j + 1]);
      }
      for (int r = 0; r < AMX_ROWS; ++r) {
        const int64_t row = r0 + r, at = row * blocks + b0;
        float* row_acc = acc[row - row_begin];
        float* row_accm = accm[row - row_begin];
        __m512 sum = _mm512_load_ps(row_acc), sum_mins = _mm512_load_ps(row_accm);
        for (int j = 0; j < n; ++j) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[j] + r * TILE));
          sum = _mm512_fmadd_ps(dot, _mm512_mul_ps(_mm512_load_ps(scales[j]), _mm512_set1_ps(a.scales[at + j])), sum);
          if (bits == 4)
            sum_mins = _mm512_fmadd_ps(_mm512_load_ps(mins[j]), _mm512_set1_ps(a.shifts[at + j]), sum_mins);
        }
        _mm512_store_ps(row_acc, sum);
        _mm512_store_ps(row_accm, sum_mins);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 sum = _mm512_load_ps(acc[r]);
    _mm512_storeu_ps(y + (row_begin + r) * y_stride, bits == 4 ? _mm512_add_ps(sum, _mm512_load_ps(accm[r])) : sum);
  }
}

// Attention against an int8 cache: the exact int32 dot products of 16 consecutive keys with up to 32 query vectors,
// which AVX-512 VNNI computes with one vpdpbusd per key, vector and 64 codes. Tile 0 (1): keys x query vectors
// 0-15 (16-31); 2: 16 keys' codes c*64 .. c*64+63 (rows key_stride bytes apart); 3 and 4: those codes of vectors
// 0-15 and 16-31 in the layout tdpbssd reads (amx_query_layout).
TileConfig key_dots_config() {
  TileConfig config;
  for (int t = 0; t < 5; ++t) config.rows[t] = 16, config.bytes_per_row[t] = 64;
  return config;
}

// B [chunks][2][16][64]: chunk c's codes of vector 16t + n, bytes 4i .. 4i+3, at [c][t][i][4n ..]; zero past the
// vectors. codes: vector m's chunk c of 64 at codes[(c * vectors + m) * 64] (the tile layout).
void amx_query_layout(const int8_t* codes, int64_t vectors, int64_t chunks, int8_t* b) {
  std::memset(b, 0, chunks * 2 * 1024);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t m = 0; m < vectors; ++m)
      for (int i = 0; i < 16; ++i)
        std::memcpy(b + ((c * 2 + m / 16) * 16 + i) * 64 + 4 * (m % 16), codes + (c * vectors + m) * 64 + 4 * i, 4);
}

// A 16 x 16 int32 matrix transposed: out[j][i] = in[i][j] (three stages of interleaves).
inline void transpose16x16(const int32_t* in, int32_t* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(in + 16 * i);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane L: rows i, i+1 of columns 4L, 4L+1 / 4L+2, 4L+3
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // r[g + k], lane L: rows g .. g+3 of column 4L + k
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k = lane L of r[k], r[4 + k], r[8 + k], r[12 + k]
    const __m512i v = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), w = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xDD);
    const __m512i x = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88), y = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xDD);
    _mm512_store_si512(out + 16 * k, _mm512_shuffle_i32x4(v, x, 0x88));
    _mm512_store_si512(out + 16 * (4 + k), _mm512_shuffle_i32x4(w, y, 0x88));
    _mm512_store_si512(out + 16 * (8 + k), _mm512_shuffle_i32x4(v, x, 0xDD));
    _mm512_store_si512(out + 16 * (12 + k), _mm512_shuffle_i32x4(w, y, 0xDD));
  }
}

// dots[m][i] = the dot product of query vector m (m < vectors <= 32) with key i of the 16 at `keys`, over chunks x 64
// codes: exact, as every path's.
void amx_key_dots(const int8_t* keys, int64_t key_stride, int64_t chunks, const int8_t* b, int64_t vectors,
                  int32_t (*dots)[16]) {
  static const TileConfig config = key_dots_config();
  alignas(64) int32_t c0[16][16], c1[16][16];
  amx_load(config);
  const bool two = vectors > 16;
  _tile_zero(0);
  if (two) _tile_zero(1);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(2, keys + 64 * c, key_stride);
    _tile_loadd(3, b + c * 2048, 64);
    _tile_dpbssd(0, 2, 3);
    if (two) {
      _tile_loadd(4, b + c * 2048 + 1024, 64);
      _tile_dpbssd(1, 2, 4);
    }
  }
  _tile_stored(0, c0, 64);
  transpose16x16(&c0[0][0], &dots[0][0]);
  if (two) {
    _tile_stored(1, c1, 64);
    transpose16x16(&c1[0][0], &dots[16][0]);
  }
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------------
// Prompt arithmetic (AMX, a prefill's decoder layers only): activations rounded to bfloat16, weights decompressed
// once per call to bfloat16 (w = scale * code + min, rounded once), and tdpbf16ps accumulating each output in a
// float32 tile across all inputs, with one store per panel of PROMPT_PANEL blocks. The int8 path above stores and
// rescales every block's dot products, which caps it far below the tile unit's rate; this one keeps the tiles busy.
// A row's numbers still depend on that row alone (its own rounded activations, the same weights, the same order of
// accumulation, whatever rows, chunk or thread count), so a prompt prefilled in any chunks gives the same bits, and a
// prompt restored from the prefix cache equals a full prefill. They differ from the int8 path's numbers, which is why
// only the prompt takes this path: plain and speculative decoding share a prompt's prefill, and every verified or
// decoded row keeps the int8 arithmetic, so speculation stays token-identical to plain decoding.
constexpr int PROMPT_PANEL = 32;  // blocks per pass: the rows' bfloat16 activations of a panel stay in L2 while every
                                  // column tile of the thread reads them
constexpr int PROMPT_PREFETCH = 2;  // blocks ahead whose activations are requested into L1

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")

// Tiles 0-3: float32 sums [16 rows, 16 columns] of row groups 0/1 x column tiles 0/1 (0: rows 0-15 x tile 0, 1: rows
// 0-15 x tile 1, 2: rows 16-31 x tile 0, 3: rows 16-31 x tile 1); 4, 5: those rows' activations [16 rows, 32
// bfloat16]; 6, 7: the two column tiles' weights of one block [16 input pairs, 16 columns x 2 bfloat16].
TileConfig prompt_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.bytes_per_row[t] = 64;
  return config;
}

// One packed block (16 columns x 32 inputs) -> out [16 pairs p][16 columns j][2]: inputs 2p, 2p+1 of column j, the
// layout tdpbf16ps reads its second operand in.
void decompress_block(int bits, const uint8_t* blk, uint16_t* out) {
  alignas(64) static const uint16_t pair_order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(pair_order);
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (bits == 4 ? 256 : 512))));
  // pair p of inputs (2p, 2p+1) -> 16 columns' [bf16 w(2p), bf16 w(2p+1)], rounded to nearest even
  const auto store_pair = [&](int p, __m512 even, __m512 odd) {
    const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
    _mm512_storeu_si512(out + 32 * p, _mm512_permutexvar_epi16(order, halves));
  };
  if (bits == 4) {
    const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    const __m512i low4 = _mm512_set1_epi32(0x0F);
    const auto weight = [&](__m512i lanes, int shift) {
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(lanes, shift), low4)), scale, min);
    };
    for (int c = 0; c < 4; ++c) {  // chunk c: bytes b of column j hold inputs 4c + b (low) and 16 + 4c + b (high)
      const __m512i lanes = _mm512_loadu_si512(blk + 64 * c);
      for (int h = 0; h < 2; ++h) {  // bytes 2h, 2h + 1: pairs 2c + h and 8 + 2c + h
        store_pair(2 * c + h, weight(lanes, 16 * h), weight(lanes, 16 * h + 8));
        store_pair(8 + 2 * c + h, weight(lanes, 16 * h + 4), weight(lanes, 16 * h + 12));
      }
    }
  } else {
    const auto weight = [&](__m512i lanes, int byte) {  // byte `byte` of each lane, sign-extended, times the scale
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lanes, 24 - 8 * byte), 24)), scale);
    };
    for (int c = 0; c < 8; ++c) {  // chunk c: byte b of column j holds input 4c + b
      const __m512i lanes = _mm512_loadu_si512(blk + 64 * c);
      store_pair(2 * c, weight(lanes, 0), weight(lanes, 1));
      store_pair(2 * c + 1, weight(lanes, 2), weight(lanes, 3));
    }
  }
}

// rows x [rows, k] float32 (row stride `stride`) -> bfloat16 [padded, k], rows past `rows` zero.
void bf16_rows(const float* x, int64_t rows, int64_t padded, int64_t k, int64_t stride, uint16_t* a) {
  at::parallel_for(0, padded, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* row = a + r * k;
      if (r >= rows) {
        std::memset(row, 0, k * sizeof(uint16_t));
        continue;
      }
      for (int64_t i = 0; i < k; i += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * stride + i + 16), _mm512_loadu_ps(x + r * stride + i));
        _mm512_storeu_si512(row + i, reinterpret_cast<__m512i>(v));
      }
    }
  });
}

// Column tiles t0 (and t0 + 1 where `two`) of 32 rows, one panel of n blocks: sums continued from c (row stride
// c_stride floats) unless `first`, and stored back there.
inline void prompt_panel(const uint16_t* a0, int64_t a_stride, const uint16_t* b0, const uint16_t* b1, int64_t n,
                         bool two, bool first, float* c, int64_t c_stride) {
  float* c_low = c + 16 * c_stride;  // rows 16-31
  const int64_t a_bytes = a_stride * 2, c_bytes = c_stride * 4;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, c_bytes);
    _tile_loadd(2, c_low, c_bytes);
    if (two) {
      _tile_loadd(1, c + TILE, c_bytes);
      _tile_loadd(3, c_low + TILE, c_bytes);
    }
  }
  const uint16_t* a1 = a0 + 16 * a_stride;
  for (int64_t j = 0; j < n; ++j) {
    // the rows' activations of a later block into L1: tile loads from L2 wait, the hardware prefetcher does not
    // follow rows this far apart
    if (j + PROMPT_PREFETCH < n)
      for (int r = 0; r < 16; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(a0 + r * a_stride + (j + PROMPT_PREFETCH) * BLOCK), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a1 + r * a_stride + (j + PROMPT_PREFETCH) * BLOCK), _MM_HINT_T0);
      }
    _tile_loadd(4, a0 + j * BLOCK, a_bytes);
    _tile_loadd(5, a1 + j * BLOCK, a_bytes);
    _tile_loadd(6, b0 + j * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
      _tile_loadd(7, b1 + j * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_bytes);
  _tile_stored(2, c_low, c_bytes);
  if (two) {
    _tile_stored(1, c + TILE, c_bytes);
    _tile_stored(3, c_low + TILE, c_bytes);
  }
}

// rows x [rows, k] float32 times the packed weights -> out [rows, tiles * 16] (row stride out_stride), in the
// prompt arithmetic. Threads split the column tiles (in pairs); each thread goes through the inputs panel by panel,
// decompressing its tiles' blocks of that panel once for all rows.
void prompt_linear_amx(int bits, const float* x, int64_t rows, int64_t k, int64_t stride, const uint8_t* weights,
                       int64_t tiles, int64_t blocks, int64_t block_bytes, float* out, int64_t out_stride) {
  const int64_t padded = (rows + 31) / 32 * 32, full = rows / 32 * 32, width = tiles * TILE;
  Uninit<uint16_t> a;  // [padded, k] bfloat16
  a.resize(padded * k);
  bf16_rows(x, rows, padded, k, stride, a.data());
  Uninit<float> tail;  // the last, partial row group's sums [32, width]
  if (padded > full) tail.resize(32 * width);
  const int64_t tile_bytes = blocks * block_bytes;
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    static const TileConfig config = prompt_config();
    amx_load(config);
    Uninit<uint16_t> b;  // [2][PROMPT_PANEL][512]: the pair's decompressed blocks of the panel
    b.resize(2 * PROMPT_PANEL * 512);
    for (int64_t p0 = 0; p0 < blocks; p0 += PROMPT_PANEL) {
      const int64_t n = std::min<int64_t>(PROMPT_PANEL, blocks - p0);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t t0 = 2 * pair;
        const bool two = t0 + 1 < tiles;
        for (int64_t j = 0; j < n; ++j) {
          decompress_block(bits, weights + t0 * tile_bytes + (p0 + j) * block_bytes, b.data() + j * 512);
          if (two)
            decompress_block(bits, weights + (t0 + 1) * tile_bytes + (p0 + j) * block_bytes,
                             b.data() + (PROMPT_PANEL + j) * 512);
        }
        for (int64_t r0 = 0; r0 < padded; r0 += 32) {
          const bool in_out = r0 < full;
          float* c = in_out ? out + r0 * out_stride + t0 * TILE : tail.data() + t0 * TILE;
          prompt_panel(a.data() + r0 * k + p0 * BLOCK, k, b.data(), b.data() + PROMPT_PANEL * 512, n, two, p0 == 0,
                       c, in_out ? out_stride : width);
        }
      }
    }
  });
  for (int64_t r = full; r < rows; ++r)
    std::memcpy(out + r * out_stride, tail.data() + (r - full) * width, width * sizeof(float));
}

#pragma GCC pop_options
#else
bool amx_permitted() { return false; }
void prompt_linear_amx(int, const float*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                       int64_t) {}
void tile_rows_amx(int, const uint8_t*, int64_t, const QuantRows&, int64_t, int64_t, float*, int64_t) {}
void amx_query_layout(const int8_t*, int64_t, int64_t, int8_t*) {}
void amx_key_dots(const int8_t*, int64_t, int64_t, const int8_t*, int64_t, int32_t (*)[16]) {}
#endif

void run_tile(int isa, int bits, const uint8_t* tile, int64_t blocks, const QuantRows& a, int64_t row_begin,
              int64_t row_end, float* y, int64_t y_stride) {
  if (isa == SCALAR) {
    const auto scalar = bits == 4 ? q4_tile_scalar : q8_tile_scalar;
    scalar(tile, blocks, a, row_begin, row_end - row_begin, y + row_begin * y_stride, y_stride);
    return;
  }
  if (isa == AMX && row_end - row_begin >= AMX_MIN_ROWS && amx_permitted()) {
    const int64_t chunks = (row_end - row_begin) / AMX_ROWS;
    if (chunks > 0) tile_rows_amx(bits, tile, blocks, a, row_begin, chunks, y, y_stride);
    row_begin += chunks * AMX_ROWS;
  }
  const int widest = isa >= AVX512 ? MAX_ROWS_AVX512 : MAX_ROWS_AVX2;
  for (int64_t r0 = row_begin; r0 < row_end;) {
    const int n = static_cast<int>(std::min<int64_t>(widest, row_end - r0));
    TileFn fn = isa >= AVX512 ? avx512_kernel(n) : avx2_kernel(n);
    fn(bits, tile, blocks, a, r0, y + r0 * y_stride, y_stride);
    r0 += n;
  }
}

}  // namespace

namespace {

void check_packed(const torch::Tensor& packed, int64_t bits, int64_t k) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "bad packed");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(k == packed.size(1) * BLOCK, "x has ", k, " inputs, the weights ", packed.size(1) * BLOCK);
  TORCH_CHECK(packed.size(2) == (bits == 4 ? Q4_BYTES : Q8_BYTES), "packed tile size does not match bits");
}

// rows x [rows, k] (row stride `stride`) times the packed weights -> out [rows, tiles * 16] (row stride out_stride).
// With `prompt`, where the CPU has AMX, in the prompt arithmetic (prompt_linear_amx).
void quant_linear_into(const float* x, int64_t rows, int64_t k, int64_t stride, const torch::Tensor& packed,
                       int64_t bits, int64_t isa, float* out, int64_t out_stride, bool prompt = false) {
  if (rows == 0) return;
  const int64_t tiles = packed.size(0), blocks = packed.size(1);
  if (prompt && isa == AMX && amx_permitted()) {
    return prompt_linear_amx(static_cast<int>(bits), x, rows, k, stride, packed.data_ptr<uint8_t>(), tiles, blocks,
                             packed.size(2), out, out_stride);
  }
  const QuantRows a = quantize_rows(x, rows, k, stride, static_cast<int>(isa));
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  const int64_t tile_bytes = blocks * packed.size(2);
  // One pass over the weights per ROW_BLOCK rows (a prefill's many rows): those rows' activations then stay in
  // cache while every tile reads them. A row's arithmetic does not depend on the pass it is in.
  for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
    const int64_t r1 = std::min(rows, r0 + ROW_BLOCK);
    at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        run_tile(static_cast<int>(isa), static_cast<int>(bits), weights + t * tile_bytes, blocks, a, r0, r1,
                 out + t * TILE, out_stride);
    });
  }
}

}  // namespace

// x [M, K] float32 (row stride may exceed K), packed [tiles, K/32, bytes] uint8 -> [M, tiles * 16] float32.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t bits, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x must be [M, K] float32");
  check_packed(packed, bits, x.size(1));
  auto y = torch::empty({x.size(0), packed.size(0) * TILE}, x.options());
  quant_linear_into(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), packed, bits, isa, y.data_ptr<float>(),
                    y.size(1));
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// Attention.
namespace {

// The int8 KV cache format: per token and KV head, D int8 codes (quantize_codes) then the float32 scale and 4 zero
// bytes, D + 8 bytes an entry (float32: 4 D). A value reads as float(code) * scale. A query meeting int8 keys is
// quantized the same way per (row, head), so that its dot product with a key is exact in int32 on every path and
// its score is float(dot) * (query scale * softmax scale * key scale), the same two roundings everywhere: rows stay
// exact, and a quarter of float32's bytes stream from memory each step.
constexpr int64_t Q8_EXTRA = 8;

void quantize_entry(const float* x, int64_t d, int8_t* entry) {
  int32_t sum;
  const float scale = quantize_codes(x, d, entry, sum);
  std::memcpy(entry + d, &scale, sizeof scale);
  std::memset(entry + d + sizeof scale, 0, Q8_EXTRA - sizeof scale);
}

inline float entry_scale(const int8_t* entry, int64_t d) {
  float scale;
  std::memcpy(&scale, entry + d, sizeof scale);
  return scale;
}

// A query against int8 keys: its codes, their sum and its factor (scale * softmax scale).
struct QueryCodes {
  std::vector<int8_t> codes;
  int32_t sum = 0;
  float factor = 0.f;
  void quantize(const float* query, int64_t d, float softmax_scale) {
    codes.resize(d);
    factor = quantize_codes(query, d, codes.data(), sum) * softmax_scale;
  }
};

// What every path computes from a key's exact integer dot product.
inline float q8_score(int32_t dot, float factor, float key_scale) { return static_cast<float>(dot) * (factor * key_scale); }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

// exp(x) for x <= 0 (and -inf -> 0): Cody-Waite range reduction and a degree-6 polynomial, the same on every lane.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// A 16-lane sum in a fixed tree (lane i + lane i+8, then +4, +2, +1): the one every score and softmax total uses, so
// that a score reduced alone (reduce16) and sixteen reduced at once (reduce16x16) are the same number.
inline float reduce16(__m512 v) {
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  const __m128 eighth = _mm_add_ps(quarter, _mm_shuffle_ps(quarter, quarter, 0x4E));
  return _mm_cvtss_f32(_mm_add_ss(eighth, _mm_shuffle_ps(eighth, eighth, 0xB1)));
}

// Lane-wise a + b of float lanes, or (INT) of int32 lanes held in the same registers.
template <bool INT>
inline __m512 add_lanes(__m512 a, __m512 b) {
  if constexpr (INT)
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  else
    return _mm512_add_ps(a, b);
}

// Sixteen vectors v[0..15] (16 lanes each, one after another) -> lane k = reduce16(v[k]), with reduce16's pairs:
// each level adds the same two lanes of each vector, only several vectors share one instruction. INT: the lanes are
// int32 (exact sums: any order would do) and so is the result.
template <bool INT = false>
inline __m512 reduce16x16(const void* lanes) {
  const float* v = static_cast<const float*>(lanes);
  __m512 level1[8], level2[4], level3[2];
  for (int p = 0; p < 8; ++p) {  // lanes i + i+8: [vector 2p | vector 2p+1], 8 lanes each
    const __m512 a = _mm512_loadu_ps(v + 32 * p), b = _mm512_loadu_ps(v + 32 * p + 16);
    level1[p] = add_lanes<INT>(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int p = 0; p < 4; ++p)  // lanes i + i+4: vectors 4p..4p+3, 4 lanes each
    level2[p] = add_lanes<INT>(_mm512_shuffle_f32x4(level1[2 * p], level1[2 * p + 1], 0x88),
                               _mm512_shuffle_f32x4(level1[2 * p], level1[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p)  // lanes i + i+2: per 128-bit block t, vectors 8p+t and 8p+4+t, 2 lanes each
    level3[p] = add_lanes<INT>(_mm512_shuffle_ps(level2[2 * p], level2[2 * p + 1], 0x44),
                               _mm512_shuffle_ps(level2[2 * p], level2[2 * p + 1], 0xEE));
  // lanes i + i+1: lane 4t+u holds vector 4u+t; put vector k in lane k
  const __m512 sums = add_lanes<INT>(_mm512_shuffle_ps(level3[0], level3[1], 0x88),
                                     _mm512_shuffle_ps(level3[0], level3[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Values c*16 .. c*16+15 of a cache entry (D values, then the int8 format's scale) as floats.
template <typename T>
inline __m512 value_chunk(const T* entry, int64_t c, int64_t) { return load16(entry + 16 * c); }
inline __m512 value_chunk(const int8_t* entry, int64_t c, int64_t d) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(entry + 16 * c));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), _mm512_set1_ps(entry_scale(entry, d)));
}

constexpr int KEYS_AHEAD = 16;  // keys (values) prefetched ahead of a long run into L1: the cache streams from memory
constexpr int64_t BYTES_AHEAD_L2 = 16384;  // ...and this far ahead into L2 (one thread alone keeps too few lines in
                                           // flight to stream at the machine's rate, as for the weights)

// A long run streams from memory: asks for the `count` keys from `key` on KEYS_AHEAD keys ahead into L1 and
// BYTES_AHEAD_L2 bytes ahead into L2.
template <typename T>
inline void prefetch_keys_ahead(const T* key, int64_t key_stride, int64_t count) {
  const char* at = reinterpret_cast<const char*>(key);
  const int64_t stride = key_stride * int64_t(sizeof(T));
  for (int64_t line = 0; line < count * stride; line += 64) {
    _mm_prefetch(at + KEYS_AHEAD * stride + line, _MM_HINT_T0);
    _mm_prefetch(at + BYTES_AHEAD_L2 + line, _MM_HINT_T1);
  }
}

// Keys a run of scores reads: `count` of them, key `first + j` (a contiguous run) or key `list[j]`.
struct KeyRun {
  const int64_t* list;
  int64_t first, count;
  int64_t key(int64_t j) const { return list ? list[j] : first + j; }
};

// Layouts inside a tile of `vectors` query vectors (so that vector m of a loop over M is an immediate offset, not one
// more register: with 24 vectors the address arithmetic had spilled to the stack):
//   queries [D / 16][vectors][16]: vector m's chunk c at (c * vectors + m) * 16;
//   scores  [keys / 16][vectors][16]: vector m's score of its visible key j at ((j / 16) * vectors + m) * 16 + j % 16.
inline int64_t score_at(int64_t vectors, int64_t m, int64_t j) { return ((j >> 4) * vectors + m) * 16 + (j & 15); }

constexpr int KEY_BLOCK = 4, VECTOR_BLOCK = 4;  // a score register block: 4 keys x 4 query vectors

// The 16-lane sums of q * k over D in order (one FMA per chunk of 16, from zero) for MB query vectors and KEY_BLOCK
// keys, stored to sums[m][slot + i] for the first `used` keys: each loaded chunk serves 4 FMAs.
template <int MB, typename T>
inline void lane_sums(const float* queries, int64_t chunk_stride, int64_t chunks, const T* const* key, int used,
                      float (*sums)[16][16], int slot) {
  __m512 acc[MB][KEY_BLOCK];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int i = 0; i < KEY_BLOCK; ++i) acc[m][i] = _mm512_setzero_ps();
  const float* query = queries;
  for (int64_t c = 0; c < chunks; ++c, query += chunk_stride) {
    __m512 k[KEY_BLOCK];
#pragma GCC unroll 4
    for (int i = 0; i < KEY_BLOCK; ++i) k[i] = load16(key[i] + 16 * c);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const __m512 q = _mm512_load_ps(query + m * 16);
#pragma GCC unroll 4
      for (int i = 0; i < KEY_BLOCK; ++i) acc[m][i] = _mm512_fmadd_ps(q, k[i], acc[m][i]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int i = 0; i < KEY_BLOCK; ++i)
      if (i < used) _mm512_store_ps(sums[m][slot + i], acc[m][i]);
}

// The int32 lane sums of (key code + 128) * query code over D in order (one vpdpbusd per chunk of 64) for MB query
// vectors and KEY_BLOCK keys, stored to sums[m][slot + i] for the first `used` keys. The keys are the unsigned
// operand: a vector's 16 lanes then sum to its dot product + 128 * its code sum.
template <int MB>
inline void lane_dots(const int8_t* queries, int64_t chunk_stride, int64_t chunks, const int8_t* const* key, int used,
                      int32_t (*sums)[16][16], int slot) {
  __m512i acc[MB][KEY_BLOCK];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int i = 0; i < KEY_BLOCK; ++i) acc[m][i] = _mm512_setzero_si512();
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* query = queries;
  for (int64_t c = 0; c < chunks; ++c, query += chunk_stride) {
    __m512i k[KEY_BLOCK];
#pragma GCC unroll 4
    for (int i = 0; i < KEY_BLOCK; ++i) k[i] = _mm512_xor_si512(_mm512_loadu_si512(key[i] + 64 * c), bias);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const __m512i q = _mm512_loadu_si512(query + m * 64);
#pragma GCC unroll 4
      for (int i = 0; i < KEY_BLOCK; ++i) acc[m][i] = _mm512_dpbusd_epi32(acc[m][i], k[i], q);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int i = 0; i < KEY_BLOCK; ++i)
      if (i < used) _mm512_store_si512(sums[m][slot + i], acc[m][i]);
}

// A tile's queries: float (vector m's chunk c of 16 at f[(c * vectors + m) * 16]) and, against an int8 cache, their
// codes (vector m's chunk c of 64 at codes[(c * vectors + m) * 64]), code sums and factors (QueryCodes).
struct TileQueries {
  const float* f;
  const int8_t* codes;
  const int32_t* code_sums;
  const float* factors;
  int64_t vectors;
  const int8_t* amx;  // the codes in amx_query_layout where AMX computes the key dots, else null
};

// Scores of M query vectors (vectors m0 .. m0+M-1 of the tile) against a run of keys, written to scores (pointing at
// vector m0 of the scores layout) at visible index first + j, their maximum folded into best[m]. Float keys: score =
// reduce16(the 16-lane sums of q * k over D in order) * scale; int8 keys: q8_score of the exact dot product. Each key
// is loaded once for all M vectors; the lane sums of 16 keys are reduced at once (reduce16x16).
template <int M, typename T>
void score_run(const TileQueries& tile, int64_t m0, int64_t d, const T* keys, int64_t key_stride, KeyRun run,
               float scale, float* scores, int64_t first, __m512* best) {
  constexpr bool q8 = std::is_same_v<T, int8_t>;
  using Lane = std::conditional_t<q8, int32_t, float>;
  alignas(64) Lane sums[M][16][16];
  alignas(64) float lanes[16], key_scales[16] = {};
  alignas(64) int32_t amx_dots[q8 ? 32 : 1][16];
  const int64_t vectors = tile.vectors;
  for (int64_t j0 = 0; j0 < run.count; j0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, run.count - j0));
    // AMX: the whole tile's vectors against 16 consecutive keys at once (the same exact integers)
    const bool amx = q8 && tile.amx != nullptr && m0 == 0 && n == 16 && run.list == nullptr;
    if constexpr (q8) {
      if (amx) {
        const int8_t* key0 = keys + run.key(j0) * key_stride;
        prefetch_keys_ahead(key0, key_stride, 16);
        for (int i = 0; i < 16; ++i) key_scales[i] = entry_scale(key0 + i * key_stride, d);
        amx_key_dots(key0, key_stride, d / 64, tile.amx, M, amx_dots);
      }
    }
    for (int jj = 0; jj < n && !amx; jj += KEY_BLOCK) {
      const int used = std::min(KEY_BLOCK, n - jj);
      const T* key[KEY_BLOCK];
      for (int i = 0; i < KEY_BLOCK; ++i) key[i] = keys + run.key(j0 + jj + std::min(i, used - 1)) * key_stride;
      if (run.list == nullptr) prefetch_keys_ahead(key[0], key_stride, KEY_BLOCK);
      if constexpr (q8) {
        for (int i = 0; i < used; ++i) key_scales[jj + i] = entry_scale(key[i], d);
        const int8_t* queries = tile.codes + m0 * 64;
#pragma GCC unroll 8
        for (int mb = 0; mb + VECTOR_BLOCK <= M; mb += VECTOR_BLOCK)
          lane_dots<VECTOR_BLOCK>(queries + mb * 64, vectors * 64, d / 64, key, used, &sums[mb], jj);
        if constexpr (M % VECTOR_BLOCK != 0)
          lane_dots<M % VECTOR_BLOCK>(queries + (M - M % VECTOR_BLOCK) * 64, vectors * 64, d / 64, key, used,
                                      &sums[M - M % VECTOR_BLOCK], jj);
      } else {
        const float* queries = tile.f + m0 * 16;
#pragma GCC unroll 8
        for (int mb = 0; mb + VECTOR_BLOCK <= M; mb += VECTOR_BLOCK)
          lane_sums<VECTOR_BLOCK, T>(queries + mb * 16, vectors * 16, d / 16, key, used, &sums[mb], jj);
        if constexpr (M % VECTOR_BLOCK != 0)
          lane_sums<M % VECTOR_BLOCK, T>(queries + (M - M % VECTOR_BLOCK) * 16, vectors * 16, d / 16, key, used,
                                         &sums[M - M % VECTOR_BLOCK], jj);
      }
    }
    const __mmask16 live = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const int64_t at = first + j0;  // visible index of this group's first key
    for (int m = 0; m < M; ++m) {
      __m512 s;
      if constexpr (q8) {  // q8_score, sixteen keys at once
        const __m512i dots =
            amx ? _mm512_load_si512(amx_dots[m])
                : _mm512_sub_epi32(_mm512_castps_si512(reduce16x16<true>(&sums[m][0][0])),
                                   _mm512_set1_epi32(128 * tile.code_sums[m0 + m]));
        s = _mm512_mul_ps(_mm512_cvtepi32_ps(dots),
                          _mm512_mul_ps(_mm512_set1_ps(tile.factors[m0 + m]), _mm512_load_ps(key_scales)));
      } else {
        s = _mm512_mul_ps(reduce16x16(&sums[m][0][0]), _mm512_set1_ps(scale));
      }
      best[m] = _mm512_mask_max_ps(best[m], live, best[m], s);
      if ((at & 15) == 0) {  // the group is one block of the layout
        _mm512_mask_storeu_ps(scores + score_at(vectors, m, at), live, s);
      } else {  // a tail's group straddles two blocks (tails are short)
        _mm512_store_ps(lanes, s);
        for (int i = 0; i < n; ++i) scores[score_at(vectors, m, at + i)] = lanes[i];
      }
    }
  }
}

// Vector m's n scores -> unnormalized probabilities exp(s - max) in place, lanes past n zeroed; returns 1 / their
// total (summed in 16-lane blocks by visible index, then reduce16).
inline float softmax_vector(float* scores, int64_t vectors, int64_t m, int64_t n, float best) {
  __m512 total = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(best);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    float* block = scores + score_at(vectors, m, j);
    const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, block), shift)));
    _mm512_storeu_ps(block, p);
    total = _mm512_add_ps(total, p);
  }
  return 1.f / reduce16(total);
}

// A value pass's M x S running sums in registers: vector m's chunk c0 + c, held at acc_out + m * d + 16 * (c0 + c)
// between passes (inlined always, or GCC keeps the accumulators in memory).
template <int M, int S>
__attribute__((always_inline)) inline void load_sums(__m512 (&acc)[M][S], const float* acc_out, int64_t d,
                                                     int64_t c0) {
#pragma GCC unroll 24
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 24
    for (int c = 0; c < S; ++c) acc[m][c] = _mm512_loadu_ps(acc_out + m * d + 16 * (c0 + c));
}
template <int M, int S>
__attribute__((always_inline)) inline void store_sums(const __m512 (&acc)[M][S], float* acc_out, int64_t d,
                                                      int64_t c0) {
#pragma GCC unroll 24
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 24
    for (int c = 0; c < S; ++c) _mm512_storeu_ps(acc_out + m * d + 16 * (c0 + c), acc[m][c]);
}

// acc[m][c0 .. c0+S) (running sums in memory between runs) += p(m, j) * value(j) over a run of values in order, S
// chunks of 16 at a time; p(m, j) is vector m's probability at visible index first + j (the scores layout; probs
// points at vector 0 of M). S is a constant so that the M * S sums stay in registers.
template <int M, int S, typename T>
void weigh_pass(const float* probs, int64_t vectors, const T* values, int64_t value_stride, KeyRun run,
                int64_t first, int64_t d, int64_t c0, float* acc_out) {
  __m512 acc[M][S];
  load_sums(acc, acc_out, d, c0);
  for (int64_t j = 0; j < run.count; ++j) {
    const T* value = values + run.key(j) * value_stride;
    if (run.list == nullptr && (c0 == 0 || !std::is_same_v<T, int8_t>)) {  // an int8 entry's first pass takes it all
      // the chunks this pass reads; an int8 entry's scale, which every pass reads, lies past its codes: the whole entry
      const int64_t first = std::is_same_v<T, int8_t> ? 0 : 16 * c0 * int64_t(sizeof(T));
      const int64_t bytes = std::is_same_v<T, int8_t> ? value_stride : 16 * S * int64_t(sizeof(T));
      const char* entry = reinterpret_cast<const char*>(value) + first;
      for (int64_t line = 0; line < bytes; line += 64) {
        _mm_prefetch(entry + KEYS_AHEAD * value_stride * int64_t(sizeof(T)) + line, _MM_HINT_T0);
        _mm_prefetch(entry + BYTES_AHEAD_L2 + line, _MM_HINT_T1);
      }
    }
    const float* p = probs + score_at(vectors, 0, first + j);  // vector m's at p[m * 16]
#pragma GCC unroll 24
    for (int c = 0; c < S; ++c) {
      const __m512 v = value_chunk(value, c0 + c, d);
#pragma GCC unroll 24  // unrolled, or GCC keeps the accumulators in memory
      for (int m = 0; m < M; ++m) acc[m][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[m * 16]), v, acc[m][c]);
    }
  }
  store_sums(acc, acc_out, d, c0);
}

constexpr int64_t VALUE_BLOCK_BYTES = 16384;  // values per block of a run: with their probabilities, what stays in L1
                                              // across the passes over D

// A run of values by blocks of `block` values (which stay in L1), and for each block the passes over D's `chunks`
// chunks of 16: as many at a time as registers hold sums for M vectors (SPAN), then single chunks.
// pass(std::integral_constant<int, chunks of this pass>, the block's run, its first index j0, the first chunk c0).
template <int M, typename Pass>
inline void value_passes(KeyRun run, int64_t block, int64_t chunks, Pass pass) {
  constexpr int SPAN = M >= 24 ? 1 : 24 / M;
  for (int64_t j0 = 0; j0 < run.count; j0 += block) {
    const KeyRun part{run.list ? run.list + j0 : nullptr, run.list ? 0 : run.first + j0,
                      std::min(block, run.count - j0)};
    int64_t c0 = 0;
    for (; c0 + SPAN <= chunks; c0 += SPAN) pass(std::integral_constant<int, SPAN>(), part, j0, c0);
    for (; c0 < chunks; ++c0) pass(std::integral_constant<int, 1>(), part, j0, c0);
  }
}

// acc[m] (M running sums [D] each) += p(m, j) * value(j) over a run of values in order: by blocks of values that stay
// in L1, for each block passes of as many D chunks as registers hold for M vectors, then single chunks (each pass
// over a whole long run streamed the values from memory again). A sum's arithmetic does not depend on the pass or
// block it is in: each element is one chain of FMAs in value order, held in memory between them.
template <int M, typename T>
void weigh_run(const float* probs, int64_t vectors, const T* values, int64_t value_stride, KeyRun run, int64_t first,
               int64_t d, float* acc_out) {
  const int64_t block = std::max<int64_t>(16, VALUE_BLOCK_BYTES / (value_stride * int64_t(sizeof(T))));
  value_passes<M>(run, block, d / 16, [&](auto span, KeyRun part, int64_t j0, int64_t c0) {
    weigh_pass<M, decltype(span)::value, T>(probs, vectors, values, value_stride, part, first + j0, d, c0, acc_out);
  });
}

constexpr int TILE_VECTORS = 24;  // query vectors (rows x heads) scored together: their sums stay in registers

template <typename T>
using ScoreFn = void (*)(const TileQueries&, int64_t, int64_t, const T*, int64_t, KeyRun, float, float*, int64_t,
                         __m512*);
template <typename T>
using WeighFn = void (*)(const float*, int64_t, const T*, int64_t, KeyRun, int64_t, int64_t, float*);

template <typename T, size_t... I>
ScoreFn<T> score_fn(int m, std::index_sequence<I...>) {
  static const ScoreFn<T> table[] = {score_run<int(I) + 1, T>...};
  return table[m - 1];
}
template <typename T, size_t... I>
WeighFn<T> weigh_fn(int m, std::index_sequence<I...>) {
  static const WeighFn<T> table[] = {weigh_run<int(I) + 1, T>...};
  return table[m - 1];
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")

// Value sums against an int8 cache in bfloat16 pairs (AVX-512 BF16, vdpbf16ps): vector m's weight of its visible
// value j is w(m, j) = bf16(p(m, j) * scale(j)); a value's codes are exact in bfloat16; one instruction adds
// w(m, 2k) * v(2k) + w(m, 2k + 1) * v(2k + 1) to sixteen float32 lanes, pair after pair in visible order. Twice the
// multiply-adds of an FMA and no per-value scaling: the float32 value sums had cost four times the instructions of
// the VNNI key dots. Pairs are by visible index, so a row's sums do not depend on where its tile's shared run ends.

// Values c*16 .. c*16+15 of two cache entries as 16 bfloat16 pairs (lane i: entry a's value i, entry b's).
inline __m512bh value_pairs(const int8_t* a, const int8_t* b, int64_t c) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * c));
  const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * c));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(x, y)));  // a0 b0 .. a7 b7
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(x, y)));  // a8 b8 .. a15 b15
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// acc[m][c0 .. c0+S) (running sums in memory between runs) += the pairs of a run of values (run.count even: visible
// indices first .. first + count - 1, first even); w16 in the scores layout holds the bfloat16 weights, so vector m's
// pair (j, j + 1) is the 32 bits at w16 + score_at(vectors, m, j).
template <int M, int S>
void weigh_pairs(const uint16_t* w16, int64_t vectors, const int8_t* values, int64_t value_stride, KeyRun run,
                 int64_t first, int64_t d, int64_t c0, float* acc_out) {
  __m512 acc[M][S];
  load_sums(acc, acc_out, d, c0);
  for (int64_t j = 0; j < run.count; j += 2) {
    const int8_t* a = values + run.key(j) * value_stride;
    const int8_t* b = values + run.key(j + 1) * value_stride;
    if (run.list == nullptr && c0 == 0) {  // the first pass over a block brings the entries in
      for (int64_t line = 0; line < 2 * value_stride; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(a) + KEYS_AHEAD * value_stride + line, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a) + BYTES_AHEAD_L2 + line, _MM_HINT_T1);
      }
    }
    const uint32_t* w = reinterpret_cast<const uint32_t*>(w16 + score_at(vectors, 0, first + j));  // m's at w[m * 8]
#pragma GCC unroll 24
    for (int c = 0; c < S; ++c) {
      const __m512bh v = value_pairs(a, b, c0 + c);
#pragma GCC unroll 24
      for (int m = 0; m < M; ++m)
        acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)_mm512_set1_epi32(static_cast<int>(w[m * 8])), v);
    }
  }
  store_sums(acc, acc_out, d, c0);
}

// weigh_run's blocks and passes, in pairs.
template <int M>
void weigh_pairs_run(const uint16_t* w16, int64_t vectors, const int8_t* values, int64_t value_stride, KeyRun run,
                     int64_t first, int64_t d, float* acc_out) {
  const int64_t block = std::max<int64_t>(16, VALUE_BLOCK_BYTES / value_stride / 2 * 2);  // even: whole pairs
  value_passes<M>(run, block, d / 16, [&](auto span, KeyRun part, int64_t j0, int64_t c0) {
    weigh_pairs<M, decltype(span)::value>(w16, vectors, values, value_stride, part, first + j0, d, c0, acc_out);
  });
}

using PairsFn = void (*)(const uint16_t*, int64_t, const int8_t*, int64_t, KeyRun, int64_t, int64_t, float*);
template <size_t... I>
PairsFn pairs_fn(int m, std::index_sequence<I...>) {
  static const PairsFn table[] = {weigh_pairs_run<int(I) + 1>...};
  return table[m - 1];
}

// Vector m's weights w(m, j) = bf16(p(m, j) * scale(j)) for visible j < n, stored in the scores layout (lanes past
// n are zero: the softmax zeroed their probabilities). scales[j]: the scale of visible value j, for j < n rounded up
// to 16.
inline void pair_weights(const float* probs, int64_t vectors, int64_t m, int64_t n, const float* scales,
                         uint16_t* w16) {
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t at = score_at(vectors, m, j);
    const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(probs + at), _mm512_loadu_ps(scales + j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w16 + at), (__m256i)_mm512_cvtneps_pbh(w));
  }
}

// The value sums of attend_tile_avx512 against an int8 cache, in bfloat16 pairs: the shared run's pairs for every
// vector of the tile, then each row's own pairs (an odd shared run's last value first, then its tail). sums [M, D]
// zeroed; probs: the softmax's unnormalized probabilities in the scores layout.
void weigh_tile_pairs(const float* probs, int rows, int heads, const int8_t* values, int64_t value_stride,
                      int64_t shared, const std::vector<std::vector<int64_t>>& tails, int64_t d, float* sums,
                      std::vector<uint16_t>& w16, std::vector<float>& scales, std::vector<int64_t>& own) {
  const int m_all = rows * heads;
  int64_t longest = 0;
  for (int r = 0; r < rows; ++r) longest = std::max<int64_t>(longest, tails[r].size());
  const int64_t padded = (shared + longest + 16) / 16 * 16;  // one more visible index for a pad
  w16.resize(padded * m_all);  // the scores layout
  scales.resize(padded);
  for (int64_t j = 0; j < shared; ++j) scales[j] = entry_scale(values + j * value_stride, d);
  for (int r = 0; r < rows; ++r) {  // each row's tail after the shared scales, the same for its heads
    const std::vector<int64_t>& tail = tails[r];
    for (size_t i = 0; i < tail.size(); ++i) scales[shared + i] = entry_scale(values + tail[i] * value_stride, d);
    std::fill(scales.begin() + shared + tail.size(), scales.end(), 0.f);
    for (int g = 0; g < heads; ++g)
      pair_weights(probs, m_all, r * heads + g, shared + tail.size(), scales.data(), w16.data());
  }
  const auto all = std::make_index_sequence<TILE_VECTORS>();
  const int64_t even = shared / 2 * 2;
  pairs_fn(m_all, all)(w16.data(), m_all, values, value_stride, KeyRun{nullptr, 0, even}, 0, d, sums);
  for (int r = 0; r < rows; ++r) {
    own.assign(tails[r].begin(), tails[r].end());
    if (shared % 2) own.insert(own.begin(), shared - 1);
    if (own.empty()) continue;
    if (own.size() % 2) own.push_back(own.back());  // the pad: weight 0
    pairs_fn(heads, all)(w16.data() + r * heads * 16, m_all, values, value_stride,
                         KeyRun{own.data(), 0, static_cast<int64_t>(own.size())}, even, d, sums + r * heads * d);
  }
}

#pragma GCC pop_options

// Which keys each row of a tile sees: `shared` = keys [0, shared) that every row sees (read once for all rows),
// then each row's own further keys in order (tails[r]).
struct TileKeys {
  int64_t shared = 0;
  std::vector<std::vector<int64_t>> tails;
};

// Attention of a tile: `rows` query rows x `heads` query heads of one KV head; queries in the tile layout above
// (vector m = row m / heads, head m % heads); out[r] points at row r's first head's output. Every (row, head) gets
// exactly the arithmetic it gets alone: the same scores, maximum, softmax total and value sums, in the same order
// (shared keys, then its tail); only the loads are shared.
// bf16_values (int8 cache, AVX-512 BF16): the value sums in bfloat16 pairs (weigh_tile_pairs).
template <typename T>
void attend_tile_avx512(const TileQueries& queries, int rows, int heads, const T* keys, const T* values,
                        int64_t key_stride, int64_t value_stride, const TileKeys& tile, int64_t d, float scale,
                        float* const* out, std::vector<float>& scores, std::vector<float>& sums, bool bf16_values,
                        std::vector<uint16_t>& w16, std::vector<float>& pair_scales, std::vector<int64_t>& own) {
  const int m_all = rows * heads;
  int64_t longest = 0;
  for (int r = 0; r < rows; ++r) longest = std::max<int64_t>(longest, tile.tails[r].size());
  scores.resize((tile.shared + longest + 15) / 16 * 16 * m_all);  // the scores layout
  sums.assign(m_all * d, 0.f);  // [M, D]
  __m512 best[TILE_VECTORS];
  for (int m = 0; m < m_all; ++m) best[m] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const auto all = std::make_index_sequence<TILE_VECTORS>();
  const KeyRun shared{nullptr, 0, tile.shared};
  score_fn<T>(m_all, all)(queries, 0, d, keys, key_stride, shared, scale, scores.data(), 0, best);
  for (int r = 0; r < rows; ++r) {
    const KeyRun tail{tile.tails[r].data(), 0, static_cast<int64_t>(tile.tails[r].size())};
    if (tail.count)
      score_fn<T>(heads, all)(queries, r * heads, d, keys, key_stride, tail, scale, scores.data() + r * heads * 16,
                              tile.shared, best + r * heads);
  }
  float inverse[TILE_VECTORS];
  for (int m = 0; m < m_all; ++m)
    inverse[m] = softmax_vector(scores.data(), m_all, m, tile.shared + tile.tails[m / heads].size(),
                                _mm512_reduce_max_ps(best[m]));
  if (std::is_same_v<T, int8_t> && bf16_values) {
    weigh_tile_pairs(scores.data(), rows, heads, reinterpret_cast<const int8_t*>(values), value_stride, tile.shared,
                     tile.tails, d, sums.data(), w16, pair_scales, own);
  } else {
    weigh_fn<T>(m_all, all)(scores.data(), m_all, values, value_stride, shared, 0, d, sums.data());
    for (int r = 0; r < rows; ++r) {
      const KeyRun tail{tile.tails[r].data(), 0, static_cast<int64_t>(tile.tails[r].size())};
      if (tail.count)
        weigh_fn<T>(heads, all)(scores.data() + r * heads * 16, m_all, values, value_stride, tail, tile.shared, d,
                                sums.data() + r * heads * d);
    }
  }
  for (int m = 0; m < m_all; ++m) {
    const __m512 inv = _mm512_set1_ps(inverse[m]);
    float* o = out[m / heads] + (m % heads) * d;
    for (int64_t c = 0; c < d; c += 16)
      _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(sums.data() + m * d + c), inv));
  }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-100.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n: n in [-145, 0] here; build it in two halves so that it stays a normal float or flushes cleanly to 0
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 two_a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 two_b = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, two_a), two_b);
}

inline float reduce256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

template <typename T>
inline __m256 value_chunk8(const T* entry, int64_t c, int64_t) { return load8(entry + 8 * c); }
inline __m256 value_chunk8(const int8_t* entry, int64_t c, int64_t d) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(entry + 8 * c));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), _mm256_set1_ps(entry_scale(entry, d)));
}

// G query heads' scores against one visible key after another: score[g * padded + j], maxima in best[g]. Float keys:
// 8-lane FMA sums over D, reduce256, times scale; int8 keys (D a multiple of 16): exact dot products (codes widened
// to int16, vpmaddwd), then q8_score.
template <int G, typename T>
void scores_avx2(const float* query, int64_t query_stride, const T* keys, int64_t key_stride,
                 const std::vector<int64_t>& visible, int64_t d, float scale, float* scores, int64_t padded,
                 float* best) {
  constexpr bool q8 = std::is_same_v<T, int8_t>;
  alignas(32) int16_t codes[q8 ? G : 1][q8 ? 256 : 1];
  float factor[G];
  if constexpr (q8) {
    TORCH_CHECK(d <= 256, "int8 KV cache: head_dim above 256");
    QueryCodes quantized;
    for (int g = 0; g < G; ++g) {
      quantized.quantize(query + g * query_stride, d, scale);
      factor[g] = quantized.factor;
      std::copy(quantized.codes.begin(), quantized.codes.end(), codes[g]);
    }
  }
  for (size_t j = 0; j < visible.size(); ++j) {
    const T* key = keys + visible[j] * key_stride;
    float s[G];
    if constexpr (q8) {
      __m256i acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_si256();
      for (int64_t c = 0; c < d; c += 16) {
        const __m256i k = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key + c)));
        for (int g = 0; g < G; ++g)
          acc[g] = _mm256_add_epi32(
              acc[g], _mm256_madd_epi16(k, _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[g] + c))));
      }
      for (int g = 0; g < G; ++g) {
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(acc[g]), _mm256_extracti128_si256(acc[g], 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        s[g] = q8_score(_mm_cvtsi128_si32(t), factor[g], entry_scale(key, d));
      }
    } else {
      __m256 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 k = load8(key + c);
        for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(query + g * query_stride + c), k, acc[g]);
      }
      for (int g = 0; g < G; ++g) s[g] = reduce256(acc[g]) * scale;
    }
    for (int g = 0; g < G; ++g) {
      scores[g * padded + j] = s[g];
      best[g] = std::max(best[g], s[g]);
    }
  }
}

// A vector's n scores -> unnormalized probabilities exp(s - max) in place (8-lane blocks from 0, lanes past n
// zeroed); returns 1 / their total (summed by blocks in order, then reduce256).
inline float softmax_row_avx2(float* row, int64_t n, float best) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 total = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(best);
  for (int64_t j = 0; j < (n + 7) / 8 * 8; j += 8) {
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), lanes);
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
    const __m256 p = _mm256_and_ps(live, exp256(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift)));
    _mm256_storeu_ps(row + j, p);
    total = _mm256_add_ps(total, p);
  }
  return 1.f / reduce256(total);
}

// attend_group_avx512 with 8 lanes (16 registers: fewer accumulators per pass).
template <int G, typename T>
void attend_group_avx2(const float* query, int64_t query_stride, const T* keys, const T* values, int64_t key_stride,
                       int64_t value_stride, const std::vector<int64_t>& visible, int64_t d, float scale, float* out,
                       std::vector<float>& scores) {
  const int64_t n = static_cast<int64_t>(visible.size());
  const int64_t padded = (n + 7) / 8 * 8, chunks = d / 8;
  scores.assign(G * padded, -std::numeric_limits<float>::infinity());  // [G, padded]
  float best[G];
  for (int g = 0; g < G; ++g) best[g] = -std::numeric_limits<float>::infinity();
  scores_avx2<G, T>(query, query_stride, keys, key_stride, visible, d, scale, scores.data(), padded, best);
  float inverse[G];
  for (int g = 0; g < G; ++g) inverse[g] = softmax_row_avx2(scores.data() + g * padded, n, best[g]);
  constexpr int SPAN = G >= 12 ? 1 : 12 / G;
  for (int64_t c0 = 0; c0 < chunks; c0 += SPAN) {
    const int span = static_cast<int>(std::min<int64_t>(SPAN, chunks - c0));
    __m256 acc[G][SPAN];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < SPAN; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const T* value = values + visible[j] * value_stride;
      for (int c = 0; c < SPAN; ++c) {
        if (c >= span) break;
        const __m256 v = value_chunk8(value, c0 + c, d);
        for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(scores[g * padded + j]), v, acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 inv = _mm256_set1_ps(inverse[g]);
      for (int c = 0; c < span; ++c) _mm256_storeu_ps(out + g * d + 8 * (c0 + c), _mm256_mul_ps(acc[g][c], inv));
    }
  }
}

// ---- AVX2 attention in tiles (attention_tiled): the rows of a tile share every load and conversion of the keys and
// values they all see, and each (row, head) vector gets attend_group_avx2's arithmetic exactly (the same scores, the
// same softmax blocking, the same chain of FMAs per value element in visible order), so a row's output does not
// depend on the tile it is in, and a tile of one row is a one-row step.
constexpr int SCORE_VECTORS_AVX2 = 8;  // query vectors per register block of scores
constexpr int WEIGH_VECTORS_AVX2 = 6;  // query vectors per register block of a value pass (x 2 chunks of 8)

// One key against VB query vectors: float keys -> reduce256(8-lane FMA sums over D in order) * scale; int8 keys ->
// q8_score of the exact dot product (codes widened to int16, vpmaddwd).
template <int VB, typename T>
inline void score_key_avx2(const float* queries, const int16_t* codes, const float* factors, const T* key, int64_t d,
                           float scale, float* s) {
  if constexpr (std::is_same_v<T, int8_t>) {
    __m256i acc[VB];
#pragma GCC unroll 16
    for (int v = 0; v < VB; ++v) acc[v] = _mm256_setzero_si256();
    for (int64_t c = 0; c < d; c += 16) {
      const __m256i k = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key + c)));
#pragma GCC unroll 16
      for (int v = 0; v < VB; ++v)
        acc[v] = _mm256_add_epi32(
            acc[v], _mm256_madd_epi16(k, _mm256_load_si256(reinterpret_cast<const __m256i*>(codes + v * d + c))));
    }
    const float key_scale = entry_scale(key, d);
#pragma GCC unroll 16
    for (int v = 0; v < VB; ++v) {
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(acc[v]), _mm256_extracti128_si256(acc[v], 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      s[v] = q8_score(_mm_cvtsi128_si32(t), factors[v], key_scale);
    }
  } else {
    __m256 acc[VB];
#pragma GCC unroll 16
    for (int v = 0; v < VB; ++v) acc[v] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 k = load8(key + c);
#pragma GCC unroll 16
      for (int v = 0; v < VB; ++v) acc[v] = _mm256_fmadd_ps(_mm256_loadu_ps(queries + v * d + c), k, acc[v]);
    }
#pragma GCC unroll 16
    for (int v = 0; v < VB; ++v) s[v] = reduce256(acc[v]) * scale;
  }
}

// Scores of vectors [m0, m0 + VB) against `count` keys (key list[j], or key0 + j without a list) at visible index
// first + j: scores[m * padded + first + j], maxima folded into best[m].
template <int VB, typename T>
void score_keys_avx2(const float* queries, const int16_t* codes, const float* factors, int64_t m0, const T* keys,
                     int64_t key_stride, const int64_t* list, int64_t key0, int64_t count, int64_t d, float scale,
                     float* scores, int64_t padded, int64_t first, float* best) {
  float s[VB];
  for (int64_t j = 0; j < count; ++j) {
    const T* key = keys + (list ? list[j] : key0 + j) * key_stride;
    score_key_avx2<VB, T>(queries + m0 * d, codes + m0 * d, factors + m0, key, d, scale, s);
#pragma GCC unroll 16
    for (int v = 0; v < VB; ++v) {
      scores[(m0 + v) * padded + first + j] = s[v];
      best[m0 + v] = std::max(best[m0 + v], s[v]);
    }
  }
}

template <typename T, size_t... I>
void score_vectors_avx2(int vb, std::index_sequence<I...>, const float* queries, const int16_t* codes,
                        const float* factors, int64_t m0, const T* keys, int64_t key_stride, const int64_t* list,
                        int64_t key0, int64_t count, int64_t d, float scale, float* scores, int64_t padded,
                        int64_t first, float* best) {
  using Fn = decltype(&score_keys_avx2<1, T>);
  static const Fn table[] = {score_keys_avx2<int(I) + 1, T>...};
  table[vb - 1](queries, codes, factors, m0, keys, key_stride, list, key0, count, d, scale, scores, padded, first,
                best);
}

// sums[m][c0 .. c0 + 16) += p(m, j) * value(j) for vectors [m0, m0 + VB) over `count` values in order (floats,
// [count][d]), p(m, j) = probs[m * padded + first + j]: one chain of FMAs per element, in memory between passes.
template <int VB>
void weigh_pass_avx2(const float* probs, int64_t padded, int64_t first, int64_t m0, const float* values,
                     int64_t count, int64_t d, int64_t c0, float* sums) {
  __m256 acc[VB][2];
#pragma GCC unroll 16
  for (int v = 0; v < VB; ++v)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) acc[v][c] = _mm256_loadu_ps(sums + (m0 + v) * d + c0 + 8 * c);
  for (int64_t j = 0; j < count; ++j) {
    const __m256 v0 = _mm256_loadu_ps(values + j * d + c0), v1 = _mm256_loadu_ps(values + j * d + c0 + 8);
#pragma GCC unroll 16
    for (int v = 0; v < VB; ++v) {
      const __m256 p = _mm256_broadcast_ss(probs + (m0 + v) * padded + first + j);
      acc[v][0] = _mm256_fmadd_ps(p, v0, acc[v][0]);
      acc[v][1] = _mm256_fmadd_ps(p, v1, acc[v][1]);
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < VB; ++v)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(sums + (m0 + v) * d + c0 + 8 * c, acc[v][c]);
}

template <size_t... I>
void weigh_vectors_avx2(int vb, std::index_sequence<I...>, const float* probs, int64_t padded, int64_t first,
                        int64_t m0, const float* values, int64_t count, int64_t d, int64_t c0, float* sums) {
  using Fn = decltype(&weigh_pass_avx2<1>);
  static const Fn table[] = {weigh_pass_avx2<int(I) + 1>...};
  table[vb - 1](probs, padded, first, m0, values, count, d, c0, sums);
}

// Vectors [m0, m1) += their probabilities times `count` values (value list[j], or key0 + j) from visible index
// `first`: by blocks of values converted once to floats (value_chunk8's numbers) that stay in L1 across the passes.
template <typename T>
void weigh_values_avx2(const float* probs, int64_t padded, int64_t first, int64_t m0, int64_t m1, const T* values,
                       int64_t value_stride, const int64_t* list, int64_t key0, int64_t count, int64_t d, float* sums,
                       std::vector<float>& floats) {
  const int64_t block = std::max<int64_t>(8, VALUE_BLOCK_BYTES / (4 * d));
  floats.resize(block * d);
  for (int64_t j0 = 0; j0 < count; j0 += block) {
    const int64_t n = std::min(block, count - j0);
    for (int64_t j = 0; j < n; ++j) {
      const T* value = values + (list ? list[j0 + j] : key0 + j0 + j) * value_stride;
      for (int64_t c = 0; c < d / 8; ++c) _mm256_storeu_ps(floats.data() + j * d + 8 * c, value_chunk8(value, c, d));
    }
    for (int64_t mb = m0; mb < m1; mb += WEIGH_VECTORS_AVX2) {
      const int vb = static_cast<int>(std::min<int64_t>(WEIGH_VECTORS_AVX2, m1 - mb));
      for (int64_t c0 = 0; c0 < d; c0 += 16)
        weigh_vectors_avx2(vb, std::make_index_sequence<WEIGH_VECTORS_AVX2>(), probs, padded, first + j0, mb,
                           floats.data(), n, d, c0, sums);
    }
  }
}

// attend_tile_avx512's work with AVX2 (d a multiple of 16): `rows` query rows x `heads` query heads of one KV head,
// queries in the tile layout, out[r] at row r's first head's output.
template <typename T>
void attend_tile_avx2(const TileQueries& tile_queries, int rows, int heads, const T* keys, const T* values,
                      int64_t key_stride, int64_t value_stride, const TileKeys& tile, int64_t d, float scale,
                      float* const* out, std::vector<float>& scores, std::vector<float>& sums,
                      std::vector<float>& query_rows, std::vector<float>& value_floats) {
  constexpr bool q8 = std::is_same_v<T, int8_t>;
  const int m_all = rows * heads;
  const int64_t vectors = tile_queries.vectors;
  // the queries as [M][D] floats and, against int8 keys, [M][D] int16 codes
  alignas(32) int16_t codes[q8 ? TILE_VECTORS * 256 : 1];
  if constexpr (q8) TORCH_CHECK(d <= 256, "int8 KV cache: head_dim above 256");
  query_rows.resize(m_all * d);
  float* queries = query_rows.data();
  for (int m = 0; m < m_all; ++m)
    for (int64_t c = 0; c < d; ++c) {
      queries[m * d + c] = tile_queries.f[((c / 16) * vectors + m) * 16 + c % 16];
      if constexpr (q8) codes[m * d + c] = tile_queries.codes[((c / 64) * vectors + m) * 64 + c % 64];
    }
  int64_t longest = 0;
  for (int r = 0; r < rows; ++r) longest = std::max<int64_t>(longest, tile.tails[r].size());
  const int64_t padded = (tile.shared + longest + 7) / 8 * 8;
  scores.assign(m_all * padded, -std::numeric_limits<float>::infinity());  // [M, padded]
  sums.assign(m_all * d, 0.f);                                             // [M, D]
  float best[TILE_VECTORS];
  for (int m = 0; m < m_all; ++m) best[m] = -std::numeric_limits<float>::infinity();
  const auto blocks = std::make_index_sequence<SCORE_VECTORS_AVX2>();
  const float* factors = tile_queries.factors;
  auto score = [&](int64_t m0, int64_t m1, const int64_t* list, int64_t count, int64_t first) {
    for (int64_t mb = m0; mb < m1; mb += SCORE_VECTORS_AVX2)
      score_vectors_avx2<T>(static_cast<int>(std::min<int64_t>(SCORE_VECTORS_AVX2, m1 - mb)), blocks, queries, codes,
                            factors, mb, keys, key_stride, list, 0, count, d, scale, scores.data(), padded, first,
                            best);
  };
  score(0, m_all, nullptr, tile.shared, 0);
  for (int r = 0; r < rows; ++r)
    if (!tile.tails[r].empty())
      score(r * heads, (r + 1) * heads, tile.tails[r].data(), tile.tails[r].size(), tile.shared);
  float inverse[TILE_VECTORS];
  for (int m = 0; m < m_all; ++m)
    inverse[m] = softmax_row_avx2(scores.data() + m * padded, tile.shared + tile.tails[m / heads].size(), best[m]);
  weigh_values_avx2(scores.data(), padded, 0, 0, m_all, values, value_stride, nullptr, 0, tile.shared, d,
                    sums.data(), value_floats);
  for (int r = 0; r < rows; ++r)
    if (!tile.tails[r].empty())
      weigh_values_avx2(scores.data(), padded, tile.shared, r * heads, (r + 1) * heads, values, value_stride,
                        tile.tails[r].data(), 0, tile.tails[r].size(), d, sums.data(), value_floats);
  for (int m = 0; m < m_all; ++m) {
    const __m256 inv = _mm256_set1_ps(inverse[m]);
    float* o = out[m / heads] + (m % heads) * d;
    for (int64_t c = 0; c < d; c += 8)
      _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(sums.data() + m * d + c), inv));
  }
}

#pragma GCC pop_options

// Value c of a cache entry as a float.
inline float value_at(const float* entry, int64_t c, int64_t) { return entry[c]; }
inline float value_at(const at::BFloat16* entry, int64_t c, int64_t) { return static_cast<float>(entry[c]); }
inline float value_at(const int8_t* entry, int64_t c, int64_t d) {
  return static_cast<float>(entry[c]) * entry_scale(entry, d);
}

template <typename T>
void attend_row_scalar(const float* query, const T* keys, const T* values, int64_t key_stride, int64_t value_stride,
                       const std::vector<int64_t>& visible, int64_t d, float scale, float* out,
                       std::vector<float>& scores) {
  constexpr bool q8 = std::is_same_v<T, int8_t>;
  const int64_t n = static_cast<int64_t>(visible.size());
  scores.assign(n, 0.f);
  QueryCodes quantized;
  if constexpr (q8) quantized.quantize(query, d, scale);
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const T* key = keys + visible[j] * key_stride;
    if constexpr (q8) {
      int32_t dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += int32_t(quantized.codes[c]) * int32_t(key[c]);
      scores[j] = q8_score(dot, quantized.factor, entry_scale(key, d));
    } else {
      float acc = 0.f;
      for (int64_t c = 0; c < d; ++c) acc = std::fma(query[c], value_at(key, c, d), acc);
      scores[j] = acc * scale;
    }
    best = std::max(best, scores[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += (scores[j] = std::exp(scores[j] - best));
  for (int64_t c = 0; c < d; ++c) out[c] = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const T* value = values + visible[j] * value_stride;
    for (int64_t c = 0; c < d; ++c) out[c] = std::fma(scores[j], value_at(value, c, d), out[c]);
  }
  for (int64_t c = 0; c < d; ++c) out[c] *= 1.f / total;
}

constexpr int MAX_GROUP = 8;  // query heads per kernel call (more are split)
template <typename T>
using GroupFn = void (*)(const float*, int64_t, const T*, const T*, int64_t, int64_t, const std::vector<int64_t>&,
                         int64_t, float, float*, std::vector<float>&);

template <typename T>
GroupFn<T> group_avx2(int heads) {
  static const GroupFn<T> table[] = {nullptr, attend_group_avx2<1, T>, attend_group_avx2<2, T>,
                                     attend_group_avx2<3, T>, attend_group_avx2<4, T>, attend_group_avx2<5, T>,
                                     attend_group_avx2<6, T>, attend_group_avx2<7, T>, attend_group_avx2<8, T>};
  return table[heads];
}

// Query heads per part of a KV head's group: with fewer work items (rows or tiles, times KV heads) than threads (one
// new token, one or two KV heads), each group is split across threads. A head's arithmetic does not depend on which
// heads share its call, so no bit changes.
int64_t heads_per_part(int64_t group, int64_t items) {
  const int64_t threads = at::get_num_threads();
  const int64_t split = items >= threads ? 1 : std::min<int64_t>(group, (threads + items - 1) / items);
  return (group + split - 1) / split;
}

// Calls fn(heads, head) for the query heads of part `part` of KV head h's group, at most MAX_GROUP at a time (head:
// the first query head of the call).
template <typename Fn>
void for_head_chunks(int64_t h, int64_t group, int64_t part, int64_t span, Fn&& fn) {
  const int64_t last = std::min(group, (part + 1) * span);
  for (int64_t g0 = part * span; g0 < last; g0 += MAX_GROUP)
    fn(static_cast<int>(std::min<int64_t>(MAX_GROUP, last - g0)), h * group + g0);
}

// Which keys a query row sees: [0, prefix) (the returned prefix), then `extra` in order; all n_keys without a mask.
int64_t row_visibility(const bool* row, int64_t n_keys, std::vector<int64_t>& extra) {
  extra.clear();
  if (row == nullptr) return n_keys;
  const void* hole = std::memchr(row, 0, n_keys);
  const int64_t prefix = hole ? static_cast<const bool*>(hole) - row : n_keys;
  for (int64_t j = prefix + 1; j < n_keys; ++j) {
    const void* next = std::memchr(row + j, 1, n_keys - j);
    if (next == nullptr) break;
    j = static_cast<const bool*>(next) - row;
    extra.push_back(j);
  }
  return prefix;
}

// Attention in tiles (AVX-512, or AVX2: attend_tile_avx2): up to TILE_VECTORS / heads consecutive query rows of one
// KV head at a time, so that the keys they all see (a verification's context, a prompt's earlier tokens) are loaded
// once for the whole tile.
template <typename T>
void attention_tiled(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                     const torch::Tensor& mask, int64_t n_keys, double scale, int64_t isa, torch::Tensor& out) {
  const bool amx = isa == AMX && amx_permitted();
  const int64_t batch = queries.size(0), hq = queries.size(1), q = queries.size(2), d = queries.size(3);
  const int64_t hkv = keys.size(1), group = hq / hkv;
  const bool masked = mask.defined() && mask.numel() > 0;
  const bool* mask_data = masked ? mask.data_ptr<bool>() : nullptr;
  const int64_t mask_keys = masked ? mask.size(2) : 0;
  const float* query_data = queries.data_ptr<float>();
  const T* key_data = keys.data_ptr<T>();
  const T* value_data = values.data_ptr<T>();
  float* out_data = out.data_ptr<float>();
  const auto qs = queries.strides(), ks = keys.strides(), vs = values.strides();
  const int64_t widest = std::max<int64_t>(1, TILE_VECTORS / std::min<int64_t>(group, MAX_GROUP));
  const int64_t span = heads_per_part(group, batch * hkv * ((q + widest - 1) / widest));
  const int64_t parts = (group + span - 1) / span;
  const int64_t rows = std::min<int64_t>(q, std::max<int64_t>(1, TILE_VECTORS / std::min<int64_t>(span, MAX_GROUP)));
  const int64_t tiles = (q + rows - 1) / rows;
  at::parallel_for(0, batch * hkv * parts * tiles, 1, [&](int64_t begin, int64_t end) {
    TileKeys tile;
    std::vector<int64_t> prefixes;
    std::vector<float> query_buf, scores, sums, factors, query_rows, value_floats;
    std::vector<int8_t> code_buf, amx_buf;
    std::vector<uint16_t> pair_weights_buf;
    std::vector<float> pair_scales;
    std::vector<int64_t> own_pairs;
    std::vector<int32_t> code_sums;
    QueryCodes query_codes;
    std::vector<float*> outs;
    for (int64_t work = begin; work < end; ++work) {
      // tiles cost more the later their rows (causal prompts): alternate cheap and dear ones so that each thread's
      // contiguous range of work gets a fair share
      const int64_t w = work % tiles, t = w % 2 == 0 ? w / 2 : tiles - 1 - w / 2;
      const int64_t part = (work / tiles) % parts, h = (work / (tiles * parts)) % hkv, b = work / (tiles * parts * hkv);
      const int64_t i0 = t * rows, n_rows = std::min(rows, q - i0);
      tile.tails.resize(n_rows);
      prefixes.resize(n_rows);
      for (int64_t r = 0; r < n_rows; ++r)
        prefixes[r] = row_visibility(masked ? mask_data + (b * q + i0 + r) * mask_keys : nullptr, n_keys,
                                     tile.tails[r]);
      tile.shared = *std::min_element(prefixes.begin(), prefixes.end());
      for (int64_t r = 0; r < n_rows; ++r) {  // tail: [shared, prefix), then the extra keys
        std::vector<int64_t>& tail = tile.tails[r];
        const int64_t own = prefixes[r] - tile.shared;
        tail.insert(tail.begin(), own, 0);
        for (int64_t j = 0; j < own; ++j) tail[j] = tile.shared + j;
      }
      const T* head_keys = key_data + b * ks[0] + h * ks[1];
      const T* head_values = value_data + b * vs[0] + h * vs[1];
      for_head_chunks(h, group, part, span, [&](int heads, int64_t head) {
        const int64_t vectors = n_rows * heads;
        query_buf.resize(vectors * d + 16);  // the tile layout, 64-byte aligned below
        float* tile_queries = query_buf.data() + (16 - reinterpret_cast<uintptr_t>(query_buf.data()) / 4 % 16) % 16;
        code_buf.resize(std::is_same_v<T, int8_t> ? vectors * d : 0);
        code_sums.resize(vectors);
        factors.resize(vectors);
        outs.resize(n_rows);
        for (int64_t r = 0; r < n_rows; ++r) {
          for (int g = 0; g < heads; ++g) {
            const int64_t m = r * heads + g;
            const float* query = query_data + b * qs[0] + (head + g) * qs[1] + (i0 + r) * qs[2];
            for (int64_t c = 0; c < d / 16; ++c)
              std::memcpy(tile_queries + (c * vectors + m) * 16, query + 16 * c, 16 * sizeof(float));
            if constexpr (std::is_same_v<T, int8_t>) {
              query_codes.quantize(query, d, float(scale));
              code_sums[m] = query_codes.sum;
              factors[m] = query_codes.factor;
              for (int64_t c = 0; c < d / 64; ++c)
                std::memcpy(code_buf.data() + (c * vectors + m) * 64, query_codes.codes.data() + 64 * c, 64);
            }
          }
          outs[r] = out_data + ((b * q + i0 + r) * hq + head) * d;
        }
        const bool key_dots_amx = std::is_same_v<T, int8_t> && amx;
        if (key_dots_amx) {
          amx_buf.resize(d / 64 * 2048);
          amx_query_layout(code_buf.data(), vectors, d / 64, amx_buf.data());
        }
        const TileQueries queries{tile_queries, code_buf.data(), code_sums.data(), factors.data(), vectors,
                                  key_dots_amx ? amx_buf.data() : nullptr};
        if (isa >= AVX512)
          attend_tile_avx512<T>(queries, static_cast<int>(n_rows), heads, head_keys, head_values, ks[2], vs[2], tile,
                                d, float(scale), outs.data(), scores, sums, isa >= AVX512_BF16, pair_weights_buf,
                                pair_scales, own_pairs);
        else
          attend_tile_avx2<T>(queries, static_cast<int>(n_rows), heads, head_keys, head_values, ks[2], vs[2], tile, d,
                              float(scale), outs.data(), scores, sums, query_rows, value_floats);
      });
    }
  });
}

template <typename T>
void attention_impl(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                    const torch::Tensor& mask, int64_t n_keys, double scale, int64_t isa, torch::Tensor& out) {
  const int64_t batch = queries.size(0), hq = queries.size(1), q = queries.size(2), d = queries.size(3);
  if (isa >= AVX2 && d % (std::is_same_v<T, int8_t> ? 64 : 16) == 0)
    return attention_tiled<T>(queries, keys, values, mask, n_keys, scale, isa, out);
  // scalar, and AVX2 with other head sizes: one (row, KV head) item at a time
  const int64_t hkv = keys.size(1), group = hq / hkv;
  const bool masked = mask.defined() && mask.numel() > 0;
  const bool* mask_data = masked ? mask.data_ptr<bool>() : nullptr;
  const float* query_data = queries.data_ptr<float>();
  const T* key_data = keys.data_ptr<T>();
  const T* value_data = values.data_ptr<T>();
  float* out_data = out.data_ptr<float>();
  const auto qs = queries.strides(), ks = keys.strides(), vs = values.strides();
  const int64_t mask_keys = masked ? mask.size(2) : 0;
  const int64_t items = batch * q * hkv, span = heads_per_part(group, items), parts = (group + span - 1) / span;
  at::parallel_for(0, items * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> visible;
    std::vector<float> scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t item = work / parts, part = work % parts;
      const int64_t b = item / (q * hkv), i = (item / hkv) % q, h = item % hkv;
      visible.clear();
      if (masked) {
        const bool* row = mask_data + (b * q + i) * mask_keys;
        for (int64_t j = 0; j < n_keys; ++j)
          if (row[j]) visible.push_back(j);
      } else {
        for (int64_t j = 0; j < n_keys; ++j) visible.push_back(j);
      }
      const T* head_keys = key_data + b * ks[0] + h * ks[1];
      const T* head_values = value_data + b * vs[0] + h * vs[1];
      for_head_chunks(h, group, part, span, [&](int heads, int64_t head) {
        const float* query = query_data + b * qs[0] + head * qs[1] + i * qs[2];
        float* o = out_data + ((b * q + i) * hq + head) * d;
        if (isa >= AVX2 && d % (std::is_same_v<T, int8_t> ? 16 : 8) == 0)
          group_avx2<T>(heads)(query, qs[1], head_keys, head_values, ks[2], vs[2], visible, d, float(scale), o,
                               scores);
        else
          for (int g = 0; g < heads; ++g)
            attend_row_scalar(query + g * qs[1], head_keys, head_values, ks[2], vs[2], visible, d, float(scale),
                              o + g * d, scores);
      });
    }
  });
}

// The head dimension of a KV cache tensor [B, Hkv, C, width]: its width, less Q8_EXTRA for int8 entries.
int64_t cache_head_dim(const torch::Tensor& cache) {
  return cache.size(3) - (cache.scalar_type() == torch::kChar ? Q8_EXTRA : 0);
}

// fn(T{}) with T the element type of a KV cache's format: float32, bfloat16 or int8 entries.
template <typename Fn>
void with_cache_type(const torch::Tensor& cache, Fn&& fn) {
  switch (cache.scalar_type()) {
    case torch::kFloat32: return fn(float{});
    case torch::kBFloat16: return fn(at::BFloat16{});
    case torch::kChar: return fn(int8_t{});
    default: TORCH_CHECK(false, "keys/values must be float32, bfloat16 or int8 entries");
  }
}

}  // namespace

// queries [B, Hq, q, D] float32 (last dim contiguous), keys/values [B, Hkv, >=n_keys, D] (float32 or bfloat16) or
// [B, Hkv, >=n_keys, D + 8] (int8 entries, quantize_entries), last dim contiguous, mask [B, q, >=n_keys] bool or empty
// (all n_keys visible) -> [B, q, Hq * D] float32.
torch::Tensor tree_attention(torch::Tensor queries, torch::Tensor keys, torch::Tensor values, torch::Tensor mask,
                             int64_t n_keys, double scale, int64_t isa) {
  TORCH_CHECK(queries.scalar_type() == torch::kFloat32 && queries.stride(3) == 1, "queries: float32, D contiguous");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() && keys.stride(3) == 1 && values.stride(3) == 1,
              "keys/values: one dtype, D contiguous");
  TORCH_CHECK(cache_head_dim(keys) == queries.size(3) && cache_head_dim(values) == queries.size(3),
              "keys/values do not match the queries' head_dim");
  TORCH_CHECK(queries.size(1) % keys.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(!mask.defined() || mask.numel() == 0 || (mask.scalar_type() == torch::kBool && mask.is_contiguous()),
              "mask: contiguous bool");
  auto out = torch::empty({queries.size(0), queries.size(2), queries.size(1) * queries.size(3)}, queries.options());
  with_cache_type(keys, [&](auto type) {
    attention_impl<decltype(type)>(queries, keys, values, mask, n_keys, scale, isa, out);
  });
  return out;
}

// x [..., D] float32 -> the int8 KV cache's entries [..., D + 8] (D codes, the float32 scale, 4 zero bytes).
torch::Tensor quantize_entries(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() >= 1, "x must be float32 [..., D]");
  const auto rows = x.contiguous().view({-1, x.size(-1)});
  const int64_t d = rows.size(1);
  auto sizes = x.sizes().vec();
  sizes.back() = d + Q8_EXTRA;
  auto out = torch::empty(sizes, x.options().dtype(torch::kChar));
  const float* source = rows.data_ptr<float>();
  int8_t* target = out.data_ptr<int8_t>();
  at::parallel_for(0, rows.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_entry(source + r * d, d, target + r * (d + Q8_EXTRA));
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Row-wise ops (RMSNorm, gated MLP activations), one fixed vector blocking per row: what a row gets never depends on
// how many rows there are or where a thread's range starts. The AVX2 code serves AVX-512 machines too.
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

void rms_norm_row_avx2(const float* x, const float* weight, int64_t d, float eps, float* out) {
  __m256 sum = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    sum = _mm256_fmadd_ps(v, v, sum);
  }
  float total = reduce256(sum);
  for (; c < d; ++c) total = std::fma(x[c], x[c], total);
  const float inverse = 1.f / std::sqrt(total / static_cast<float>(d) + eps);
  const __m256 inv = _mm256_set1_ps(inverse);
  for (c = 0; c + 8 <= d; c += 8)
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + c), inv), _mm256_loadu_ps(weight + c)));
  for (; c < d; ++c) out[c] = x[c] * inverse * weight[c];
}

// silu(g) = g / (1 + exp(-g)); gelu_tanh(g) = g / (1 + exp(-2 * sqrt(2/pi) * (g + 0.044715 g^3))).
inline __m256 gate256(__m256 g, bool gelu) {
  __m256 z = g;
  if (gelu) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f), _mm256_fmadd_ps(cube, _mm256_set1_ps(0.044715f), g));
  }
  // exp(-z) for z of either sign: exp256 takes x <= 0, so use exp(-|z|) and flip
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 e = exp256(_mm256_or_ps(z, sign));  // exp(-|z|)
  const __m256 positive = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ);
  // z >= 0: g / (1 + e); z < 0: g * e / (1 + e)
  const __m256 ratio = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  return _mm256_blendv_ps(_mm256_mul_ps(ratio, e), ratio, positive);
}

void glu_row_avx2(const float* gate, const float* up, int64_t n, bool gelu, float* out) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    _mm256_storeu_ps(out + c, _mm256_mul_ps(gate256(_mm256_loadu_ps(gate + c), gelu), _mm256_loadu_ps(up + c)));
  if (c < n) {  // the tail through the same vector code
    float g[8] = {0}, u[8] = {0}, o[8];
    std::memcpy(g, gate + c, (n - c) * 4);
    std::memcpy(u, up + c, (n - c) * 4);
    _mm256_storeu_ps(o, _mm256_mul_ps(gate256(_mm256_loadu_ps(g), gelu), _mm256_loadu_ps(u)));
    std::memcpy(out + c, o, (n - c) * 4);
  }
}

// Rotary embedding of one head row, halves layout: out[c] = x[c] cos[c] + rot[c] sin[c], rot = (-x[h:], x[:h]),
// computed as fma(x, cos, rot * sin) in every path.
void rotary_row_avx2(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t c = 0; c < half; c += 8) {
    const __m256 lo = _mm256_loadu_ps(x + c), hi = _mm256_loadu_ps(x + half + c);
    _mm256_storeu_ps(out + c, _mm256_fmadd_ps(lo, _mm256_loadu_ps(cos + c),
                                              _mm256_mul_ps(_mm256_xor_ps(hi, sign), _mm256_loadu_ps(sin + c))));
    _mm256_storeu_ps(out + half + c, _mm256_fmadd_ps(hi, _mm256_loadu_ps(cos + half + c),
                                                     _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + c))));
  }
}

#pragma GCC pop_options

void rms_norm_row_scalar(const float* x, const float* weight, int64_t d, float eps, float* out) {
  float total = 0.f;
  for (int64_t c = 0; c < d; ++c) total = std::fma(x[c], x[c], total);
  const float inverse = 1.f / std::sqrt(total / static_cast<float>(d) + eps);
  for (int64_t c = 0; c < d; ++c) out[c] = x[c] * inverse * weight[c];
}

void glu_row_scalar(const float* gate, const float* up, int64_t n, bool gelu, float* out) {
  for (int64_t c = 0; c < n; ++c) {
    const float g = gate[c];
    const float z = gelu ? 1.5957691216057308f * std::fma(g * g * g, 0.044715f, g) : g;
    out[c] = g / (1.f + std::exp(-z)) * up[c];
  }
}

void rotary_row_scalar(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t c = 0; c < half; ++c) {
    out[c] = std::fma(x[c], cos[c], -x[half + c] * sin[c]);
    out[half + c] = std::fma(x[half + c], cos[half + c], x[c] * sin[half + c]);
  }
}

// One row through the path its ISA takes; every entry point below calls these, so fused and separate calls agree.
inline void rms_norm_row(const float* x, const float* weight, int64_t d, float eps, float* out, int64_t isa) {
  if (isa >= AVX2)
    rms_norm_row_avx2(x, weight, d, eps, out);
  else
    rms_norm_row_scalar(x, weight, d, eps, out);
}

inline void glu_row(const float* gate, const float* up, int64_t n, bool gelu, float* out, int64_t isa) {
  if (isa >= AVX2)
    glu_row_avx2(gate, up, n, gelu, out);
  else
    glu_row_scalar(gate, up, n, gelu, out);
}

inline void rotary_row(const float* x, const float* cos, const float* sin, int64_t d, float* out, int64_t isa) {
  if (isa >= AVX2 && d % 16 == 0)
    rotary_row_avx2(x, cos, sin, d, out);
  else
    rotary_row_scalar(x, cos, sin, d, out);
}

}  // namespace

// x [M, d] float32, weight [d] float32 -> x * rsqrt(mean(x^2) + eps) * weight, per row.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x must be [M, d] float32");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be [d] float32");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t d = x.size(1);
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x.data_ptr<float>() + r * x.stride(0);
      float* o = out.data_ptr<float>() + r * d;
      rms_norm_row(row, w, d, static_cast<float>(eps), o, isa);
    }
  });
  return out;
}

// x [B, H, q, D] float32 (D contiguous), cos/sin [B, q, D] float32 contiguous -> rotated [B, H, q, D] contiguous.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t isa) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == torch::kFloat32 && x.stride(3) == 1, "x must be [B, H, q, D] float32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32 && cos.numel() == x.size(0) * x.size(2) * x.size(3) &&
                  sin.numel() == cos.numel(),
              "cos/sin must be [B, q, D] float32");
  const int64_t b = x.size(0), h = x.size(1), q = x.size(2), d = x.size(3);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  auto out = torch::empty({b, h, q, d}, x.options());
  const auto xs = x.strides();
  const float* xd = x.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  at::parallel_for(0, b * h * q, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bi = item / (h * q), hi = (item / q) % h, i = item % q;
      const float* row = xd + bi * xs[0] + hi * xs[1] + i * xs[2];
      const int64_t at = (bi * q + i) * d;
      rotary_row(row, cd + at, sd + at, d, od + item * d, isa);
    }
  });
  return out;
}

// gate_up [M, 2n] float32 (gate, then up) -> act(gate) * up [M, n]; act = silu, or gelu (tanh approximation).
torch::Tensor glu(torch::Tensor gate_up, bool gelu, int64_t isa) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "gate_up must be [M, 2n] float32");
  const int64_t n = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  at::parallel_for(0, gate_up.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = gate_up.data_ptr<float>() + r * gate_up.stride(0);
      float* o = out.data_ptr<float>() + r * n;
      glu_row(row, row + n, n, gelu, o, isa);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Fused steps of a decoder layer: the same row functions and linear kernel as the separate entry points above, in
// one call (a one-token forward is otherwise dominated by per-call overhead on small models). Each row still gets
// exactly the numbers the separate calls give it.

// PRE_NORM: rms_norm(x, norm); PRE_SILU / PRE_GELU: act(gate) * up of x = [gate, up].
enum Pre { PRE_NONE = 0, PRE_NORM = 1, PRE_SILU = 2, PRE_GELU = 3 };

// y = pre(x) @ W^T [+ bias] [-> rms_norm(y, post_norm)], x [M, K'] float32 -> y [M, n_out]; with a residual
// [M, n_out] float32 (contiguous), residual += y in place and the residual is returned. `prompt`: a prefill's
// layer, in the prompt arithmetic where the CPU has AMX (prompt_linear_amx).
torch::Tensor fused_linear(torch::Tensor x, torch::Tensor packed, int64_t bits, int64_t n_out, torch::Tensor bias,
                           int64_t pre, torch::Tensor norm, torch::Tensor post_norm, torch::Tensor residual,
                           double eps, int64_t isa, bool prompt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x must be [M, K] float32");
  const int64_t rows = x.size(0);
  const bool gated = pre == PRE_SILU || pre == PRE_GELU;
  const int64_t k = gated ? x.size(1) / 2 : x.size(1);
  check_packed(packed, bits, k);
  const int64_t width = packed.size(0) * TILE;
  TORCH_CHECK(n_out <= width, "n_out exceeds the packed outputs");
  const float fe = static_cast<float>(eps);
  // the linear layer's input rows
  torch::Tensor input = x;
  if (pre != PRE_NONE) {
    TORCH_CHECK(pre != PRE_NORM || (norm.scalar_type() == torch::kFloat32 && norm.is_contiguous() && norm.numel() == k),
                "norm must be [K] float32");
    input = torch::empty({rows, k}, x.options());
    const float* xd = x.data_ptr<float>();
    float* in = input.data_ptr<float>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* row = xd + r * x.stride(0);
        if (pre == PRE_NORM)
          rms_norm_row(row, norm.data_ptr<float>(), k, fe, in + r * k, isa);
        else
          glu_row(row, row + k, k, pre == PRE_GELU, in + r * k, isa);
      }
    });
  }
  auto y = torch::empty({rows, width}, x.options());
  quant_linear_into(input.data_ptr<float>(), rows, k, input.stride(0), packed, bits, isa, y.data_ptr<float>(), width,
                    prompt);
  const bool has_bias = bias.defined() && bias.numel() > 0, has_post = post_norm.defined() && post_norm.numel() > 0;
  const bool has_residual = residual.defined() && residual.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() && bias.numel() == n_out),
              "bias must be [n_out] float32");
  TORCH_CHECK(!has_post || (post_norm.scalar_type() == torch::kFloat32 && post_norm.is_contiguous() &&
                            post_norm.numel() == n_out),
              "post_norm must be [n_out] float32");
  TORCH_CHECK(!has_residual || (residual.scalar_type() == torch::kFloat32 && residual.is_contiguous() &&
                                residual.size(0) == rows && residual.size(1) == n_out),
              "residual must be [M, n_out] float32, contiguous");
  if (!has_bias && !has_post && !has_residual) return width == n_out ? y : y.narrow(1, 0, n_out);
  // Pointers read once: data_ptr() checks the tensor on every call, which in the per-element loops below cost more
  // than the additions.
  float* yd = y.data_ptr<float>();
  const float* bias_data = has_bias ? bias.data_ptr<float>() : nullptr;
  const float* post_data = has_post ? post_norm.data_ptr<float>() : nullptr;
  float* residual_data = has_residual ? residual.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(has_post ? n_out : 0);
    for (int64_t r = begin; r < end; ++r) {
      float* row = yd + r * width;
      if (has_bias)
        for (int64_t c = 0; c < n_out; ++c) row[c] = row[c] + bias_data[c];
      if (has_post) {
        rms_norm_row(row, post_data, n_out, fe, normed.data(), isa);
        std::memcpy(row, normed.data(), n_out * sizeof(float));
      }
      if (has_residual) {
        float* target = residual_data + r * n_out;
        for (int64_t c = 0; c < n_out; ++c) target[c] = target[c] + row[c];
      }
    }
  });
  if (has_residual) return residual;
  return width == n_out ? y : y.narrow(1, 0, n_out);
}

// The attention step of a decoder layer from its fused projections: qkv [B*q, (Hq + 2 Hkv) D] float32 rows ->
// per-head norms (q_norm, k_norm [D] or empty) -> rotary (cos, sin [B, q, D]) -> the new keys and values written
// into the layer's cache keys/values [B, Hkv, C, D] (float32, or bfloat16 rounded to nearest even; int8 entries
// [B, Hkv, C, D + 8]) at columns
// slots [B, q] -> attention over n_keys keys (mask [B, q, >= n_keys] bool or empty) -> [B*q, Hq D]. The rows read
// their own new keys from the cache, rounded as a later step will read them.
template <typename T>
void write_cache_row(const float* source, int64_t d, T* target) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(target, source, d * sizeof(float));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    quantize_entry(source, d, target);
  } else {
    for (int64_t c = 0; c < d; ++c) target[c] = static_cast<T>(source[c]);
  }
}

template <typename T>
void write_step_entries(const torch::Tensor& qkv, int64_t hq, int64_t hkv, const torch::Tensor& q_norm,
                        const torch::Tensor& k_norm, float eps, const torch::Tensor& cos, const torch::Tensor& sin,
                        torch::Tensor& keys, torch::Tensor& values, const int64_t* slot, int64_t q,
                        torch::Tensor& queries, int64_t isa) {
  const int64_t b = keys.size(0), d = cache_head_dim(keys);
  const bool q_normed = q_norm.defined() && q_norm.numel() > 0, k_normed = k_norm.defined() && k_norm.numel() > 0;
  const float* source = qkv.data_ptr<float>();
  float* query_data = queries.data_ptr<float>();
  T* key_data = keys.data_ptr<T>();
  T* value_data = values.data_ptr<T>();
  const auto ks = keys.strides(), vs = values.strides();
  at::parallel_for(0, b * q * (hq + hkv), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(d), rotated(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / (hq + hkv), h = item % (hq + hkv), bi = row / q, i = row % q;
      const float* x = source + row * qkv.stride(0) + h * d;
      const bool is_query = h < hq;
      const torch::Tensor& norm = is_query ? q_norm : k_norm;
      if (is_query ? q_normed : k_normed) {
        rms_norm_row(x, norm.data_ptr<float>(), d, eps, normed.data(), isa);
        x = normed.data();
      }
      const float* c = cos.data_ptr<float>() + row * d;
      const float* s = sin.data_ptr<float>() + row * d;
      if (is_query) {
        rotary_row(x, c, s, d, query_data + ((bi * hq + h) * q + i) * d, isa);
        continue;
      }
      const int64_t kv = h - hq;
      rotary_row(x, c, s, d, rotated.data(), isa);
      write_cache_row(rotated.data(), d, key_data + bi * ks[0] + kv * ks[1] + slot[row] * ks[2]);
      write_cache_row(source + row * qkv.stride(0) + (hq + hkv + kv) * d, d,  // the value head of this key head
                      value_data + bi * vs[0] + kv * vs[1] + slot[row] * vs[2]);
    }
  });
}

torch::Tensor attention_step(torch::Tensor qkv, int64_t hq, int64_t hkv, torch::Tensor q_norm, torch::Tensor k_norm,
                             double eps, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                             torch::Tensor values, torch::Tensor slots, int64_t n_keys, torch::Tensor mask,
                             double scale, int64_t isa) {
  TORCH_CHECK(keys.dim() == 4 && values.scalar_type() == keys.scalar_type() && keys.stride(3) == 1 &&
                  values.stride(3) == 1 && values.size(3) == keys.size(3),
              "keys/values must be [B, Hkv, C, D] float32 or bfloat16, or [B, Hkv, C, D + 8] int8 entries");
  const int64_t b = keys.size(0), d = cache_head_dim(keys), heads = hq + 2 * hkv;
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == b && slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "slots must be [B, q] int64");
  const int64_t q = slots.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.stride(1) == 1 && qkv.size(0) == b * q &&
                  qkv.size(1) == heads * d,
              "qkv must be [B*q, (Hq + 2 Hkv) D] float32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == b * q * d && sin.numel() == b * q * d &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "cos/sin must be [B, q, D] float32");
  const bool q_normed = q_norm.defined() && q_norm.numel() > 0, k_normed = k_norm.defined() && k_norm.numel() > 0;
  TORCH_CHECK(!q_normed || (q_norm.numel() == d && q_norm.is_contiguous() && q_norm.scalar_type() == torch::kFloat32),
              "q_norm must be [D] float32");
  TORCH_CHECK(!k_normed || (k_norm.numel() == d && k_norm.is_contiguous() && k_norm.scalar_type() == torch::kFloat32),
              "k_norm must be [D] float32");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < b * q; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < keys.size(2) && slot[i] < n_keys, "a slot is outside the cache");
  TORCH_CHECK(!mask.defined() || mask.numel() == 0 || (mask.scalar_type() == torch::kBool && mask.is_contiguous()),
              "mask: contiguous bool");
  auto queries = torch::empty({b, hq, q, d}, qkv.options());
  auto out = torch::empty({b, q, hq * d}, qkv.options());
  const float fe = static_cast<float>(eps);
  with_cache_type(keys, [&](auto type) {
    using T = decltype(type);
    write_step_entries<T>(qkv, hq, hkv, q_norm, k_norm, fe, cos, sin, keys, values, slot, q, queries, isa);
    attention_impl<T>(queries, keys, values, mask, n_keys, scale, isa, out);
  });
  return out.view({b * q, hq * d});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_built", [] { return bool(SPECDECODE_AMX); }, "whether this build has the AMX path");
  m.def("rms_norm", &rms_norm, "RMSNorm per row, rows independent");
  m.def("rotary", &rotary, "rotary embedding per head row, rows independent");
  m.def("glu", &glu, "act(gate) * up per row, rows independent");
  m.def("quant_linear", &quant_linear, "int4/int8 weights x int8 activations, rows independent");
  m.def("tree_attention", &tree_attention, "attention over each row's visible keys, rows independent");
  m.def("quantize_entries", &quantize_entries, "float32 keys or values -> int8 KV cache entries");
  m.def("fused_linear", &fused_linear, "norm or glu, linear, bias, post-norm, residual add in one call");
  m.def("attention_step", &attention_step, "q/k norms, rotary, cache write and attention in one call");
}
