// A CPU int4 weight-only matmul for few activation rows (decode at batch 1-8, short prompts), reading
// the weights of runtime/cpu_linear.py's Int4Slots as they are (no second copy): y = a @ w.T.
//
// Why: aten._weight_int4pack_mm_for_cpu dequantizes every weight to float (w = (u - 8) s + z) and
// then multiplies it by each row: compute-bound, 6.8 GB/s of packed bytes at one row and 1.8 GB/s at
// eight on a Sapphire Rapids core, where a dense bf16 mv reads 16 GB/s. Here the scale and zero
// are applied once per group on the accumulators instead of once per weight:
//     y[m, n] = sum_g s[g, n] * (a[m, g] . u[g, n]) + (z[g, n] - 8 s[g, n]) * sum(a[m, g])
// where u (0..15) is exact in bf16, so the inner loop is bf16 dot products of the activations with
// the nibbles (AMX tiles, or vdpbf16ps), after two byte shuffles and four bitwise ops per 64 outputs
// and two inputs have turned nibbles into bf16 values (Nibbles).
//
// Input: `a` bf16 [M, K] contiguous; `packed` uint8 [N, K/2] as _convert_weight_to_int4pack_for_cpu
// lays it out (outputs in blocks of `block_n`, each block stored [K, block_n/2] bytes, the last block
// possibly partial; byte j of a full block holds outputs j (low nibble) and j + block_n/2 (high) when
// `halves`, else 2j and 2j+1, as a partial block always does); `scale_zeros` bf16 [K/group, N, 2].
// Output: bf16 [M, N], float32 sums rounded once to nearest even, as aten's.
//
// Paths, each in the builds of the levels that have its instructions (common.h's LOWBIT_HAS_*;
// runtime/native builds one module per level): AMX and AVX512-BF16 + VBMI for full blocks of 64
// with `halves`; AVX2 + FMA for full blocks of 32 or 64 with `halves`; a portable loop
// (auto-vectorized for the build's flags) for everything else, partial blocks included.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: all of libtorch's headers, a minute to build
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kMaxRows = 256;   // rows per call (runtime/cpu_int4_gemm.py takes fewer)
constexpr int64_t kMaxBlock = 64;   // outputs per block the portable path holds
constexpr int64_t kMaxGroup = 256;  // inputs per group the AMX path holds in L1

struct Problem {
  const uint16_t* a;      // bf16 [M, K]
  const float* a_float;   // [M, K] (portable path)
  const float* row_sums;  // [M, K / group]: sum of a over each group
  const uint8_t* packed;
  const uint16_t* scale_zeros;  // [K / group, N, 2]
  uint16_t* out;          // bf16 [M, N]
  int64_t m, n, k, group;
};

// A buffer of at least `size` values: grown, never shrunk, so a thread_local one allocates only when a
// call is larger than every one before it
template <class T>
T* at_least(std::vector<T>& v, int64_t size) {
  if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  return v.data();
}

// ---------------------------------------------------------------- portable path (any block)

// Outputs [n0, n0 + size) of the block whose bytes start at `bytes` ([K, size / 2]).
void block_portable(const Problem& p, const uint8_t* bytes, int64_t n0, int64_t size, bool halves) {
  const int64_t groups = p.k / p.group, half = size / 2;
  thread_local std::vector<float> total_buffer, acc_buffer;  // this thread's, kept between calls
  float* total = at_least(total_buffer, p.m * kMaxBlock);
  float* acc = at_least(acc_buffer, p.m * kMaxBlock);
  std::fill(total, total + p.m * kMaxBlock, 0.0f);
  float u[kMaxBlock];
  for (int64_t g = 0; g < groups; ++g) {
    std::fill(acc, acc + p.m * kMaxBlock, 0.0f);
    for (int64_t kk = g * p.group; kk < (g + 1) * p.group; ++kk) {
      const uint8_t* row = bytes + kk * half;
      for (int64_t j = 0; j < half; ++j) {
        if (halves) {
          u[j] = static_cast<float>(row[j] & 15);
          u[half + j] = static_cast<float>(row[j] >> 4);
        } else {
          u[2 * j] = static_cast<float>(row[j] & 15);
          u[2 * j + 1] = static_cast<float>(row[j] >> 4);
        }
      }
      for (int64_t r = 0; r < p.m; ++r) {
        const float x = p.a_float[r * p.k + kk];
        float* __restrict c = acc + r * kMaxBlock;
        for (int64_t j = 0; j < size; ++j) c[j] += x * u[j];
      }
    }
    const uint16_t* sz = p.scale_zeros + (g * p.n + n0) * 2;
    for (int64_t j = 0; j < size; ++j) {
      const float s = bf16_to_float(sz[2 * j]), offset = bf16_to_float(sz[2 * j + 1]) - 8.0f * s;
      for (int64_t r = 0; r < p.m; ++r) {
        total[r * kMaxBlock + j] += s * acc[r * kMaxBlock + j] + offset * p.row_sums[r * groups + g];
      }
    }
  }
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t j = 0; j < size; ++j) p.out[r * p.n + n0 + j] = float_to_bf16(total[r * kMaxBlock + j]);
  }
}

// ---------------------------------------------------------------- AVX2 path (blocks of 32 or 64)
// For CPUs without AVX512-BF16 (AVX2 EPYCs, most laptops; Skylake/Ice Lake's AVX-512 build runs it
// too): float FMAs on the nibbles as exact floats, the activations as floats (bf16 widened by a
// 16-bit shift). Decode streams the weight once, so per 16 bytes of a block's row (32 weights) the
// work must stay a few cycles: one zero-extending load per 8 bytes gives 8 lanes whose low nibbles
// are outputs j..j+7 and high nibbles outputs half+j.. (the `halves` order, AVX2's own blocks of 32
// and AVX-512's of 64), then an and or a shift and a convert each, and one FMA per row.
#if LOWBIT_HAS_AVX2
// rows x 16-byte spans of a block's row per pass: 4 accumulators each, in 16 ymm registers (32 zmm
// with AVX-512's VL at that level's build) beside the weights and a broadcast row value
constexpr int kAvx2Tiles = LOWBIT_HAS_AVX512 ? 4 : 2;
constexpr int64_t kAvx2Prefetch = 2048;  // bytes ahead in the block's stream, as block64_avx512

// The 32 weights of 16 bytes at `bytes` of a block's row as floats: w[0] outputs j..j+7 (low
// nibbles of bytes 0-7), w[1] j+8.. (low of 8-15), w[2] half+j.. (high of 0-7), w[3] half+j+8..
inline void nibbles_avx2(const uint8_t* bytes, __m256* w) {
  const __m256i low_nibble = _mm256_set1_epi32(15);
  const __m256i lanes0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i lanes1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8)));
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lanes0, low_nibble));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(lanes1, low_nibble));
  w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lanes0, 4));
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lanes1, 4));
}

// Rows m0 .. m0 + ROWS and spans s0 .. s0 + SPANS (16 bytes each of a row of `half` bytes) of one full
// block at `bytes` (outputs n0 ..): per group, float sums in registers, then folded into `total`
// ([ROWS][block_n] floats, this call's; kept in L1) with the group's scale and offset.
template <int ROWS, int SPANS>
void block_avx2(const Problem& p, const uint8_t* bytes, int64_t half, int64_t n0, int64_t m0, int64_t s0,
                float* total) {
  const int64_t groups = p.k / p.group;
  const __m256i high_words = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[ROWS][SPANS * 4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < SPANS * 4; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t kk = g * p.group; kk < (g + 1) * p.group; ++kk) {
      const uint8_t* row = bytes + kk * half + s0 * 16;
      _mm_prefetch(reinterpret_cast<const char*>(row + kAvx2Prefetch), _MM_HINT_T0);
      __m256 w[SPANS * 4];
      for (int s = 0; s < SPANS; ++s) nibbles_avx2(row + 16 * s, w + 4 * s);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 x = _mm256_broadcast_ss(p.a_float + (m0 + r) * p.k + kk);
        for (int j = 0; j < SPANS * 4; ++j) acc[r][j] = _mm256_fmadd_ps(w[j], x, acc[r][j]);
      }
    }
    // total += s * acc + (z - 8 s) * sum(a over the group); (scale, zero) one bf16 pair per output
    for (int s = 0; s < SPANS; ++s)
      for (int j = 0; j < 4; ++j) {
        const int64_t out = (s0 + s) * 16 + (j & 1) * 8 + (j >> 1) * half;  // within the block
        const __m256i pairs = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(p.scale_zeros + (g * p.n + n0 + out) * 2));
        const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(pairs, high_words));
        const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
        for (int r = 0; r < ROWS; ++r) {
          float* t = total + r * 2 * half + out;
          const __m256 sums = _mm256_set1_ps(p.row_sums[(m0 + r) * groups + g]);
          _mm256_storeu_ps(t, _mm256_fmadd_ps(offset, sums, _mm256_fmadd_ps(scale, acc[r][s * 4 + j], _mm256_loadu_ps(t))));
        }
      }
  }
}

// More rows than one pass holds: per 16-byte span and group, the weights unpacked into floats once
// (an L1 buffer, `group` x 32), then every pass of up to kAvx2Rows rows reads them there (an FMA's
// memory operand) instead of unpacking them again. Each row's operations and their order are the
// register path's, so its sums are the same bits.
constexpr int kAvx2Rows = LOWBIT_HAS_AVX512 ? 6 : 3;  // accumulators 4 per row, and the broadcast

template <int ROWS>
void span_rows_avx2(const Problem& p, const float* w, int64_t g, int64_t half, int64_t n0, int64_t m0, int64_t s0,
                    float* total) {
  const int64_t groups = p.k / p.group;
  __m256 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < p.group; ++i) {
    const int64_t kk = g * p.group + i;
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x = _mm256_broadcast_ss(p.a_float + (m0 + r) * p.k + kk);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(w + i * 32 + 8 * j), x, acc[r][j]);
    }
  }
  const __m256i high_words = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j = 0; j < 4; ++j) {  // as block_avx2's fold
    const int64_t out = s0 * 16 + (j & 1) * 8 + (j >> 1) * half;
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scale_zeros + (g * p.n + n0 + out) * 2));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, _mm256_castsi256_ps(_mm256_and_si256(pairs, high_words)));
    for (int r = 0; r < ROWS; ++r) {
      float* t = total + (m0 + r) * 2 * half + out;
      const __m256 sums = _mm256_set1_ps(p.row_sums[(m0 + r) * groups + g]);
      _mm256_storeu_ps(t, _mm256_fmadd_ps(offset, sums, _mm256_fmadd_ps(scale, acc[r][j], _mm256_loadu_ps(t))));
    }
  }
}

void block_avx2_buffered(const Problem& p, const uint8_t* bytes, int64_t block_n, int64_t n0, float* total) {
  const int64_t half = block_n / 2;
  alignas(32) float w[kMaxGroup * 32];
  std::fill(total, total + p.m * block_n, 0.0f);
  for (int64_t s0 = 0; s0 < half / 16; ++s0)
    for (int64_t g = 0; g < p.k / p.group; ++g) {
      for (int64_t i = 0; i < p.group; ++i) {
        const uint8_t* row = bytes + (g * p.group + i) * half + s0 * 16;
        _mm_prefetch(reinterpret_cast<const char*>(row + kAvx2Prefetch), _MM_HINT_T0);
        __m256 v[4];
        nibbles_avx2(row, v);
        for (int j = 0; j < 4; ++j) _mm256_store_ps(w + i * 32 + 8 * j, v[j]);
      }
      for (int64_t m0 = 0; m0 < p.m; m0 += kAvx2Rows) {
        switch (std::min<int64_t>(kAvx2Rows, p.m - m0)) {
          case 1: span_rows_avx2<1>(p, w, g, half, n0, m0, s0, total); break;
          case 2: span_rows_avx2<2>(p, w, g, half, n0, m0, s0, total); break;
          case 3: span_rows_avx2<3>(p, w, g, half, n0, m0, s0, total); break;
          case 4: span_rows_avx2<4>(p, w, g, half, n0, m0, s0, total); break;
          case 5: span_rows_avx2<5>(p, w, g, half, n0, m0, s0, total); break;
          default: span_rows_avx2<6>(p, w, g, half, n0, m0, s0, total); break;
        }
      }
    }
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t j = 0; j < block_n; ++j) p.out[r * p.n + n0 + j] = float_to_bf16(total[r * block_n + j]);
}

// One full block (block_n 32 or 64, `halves`) for all rows, rounded into p.out.
void block_avx2_all_rows(const Problem& p, const uint8_t* bytes, int64_t block_n, int64_t n0) {
  const int64_t half = block_n / 2, spans = half / 16;
  thread_local std::vector<float> total_buffer;  // this thread's, kept between calls
  if (p.m > kAvx2Tiles && p.group <= kMaxGroup) {
    block_avx2_buffered(p, bytes, block_n, n0, at_least(total_buffer, p.m * block_n));
    return;
  }
  float* total = at_least(total_buffer, kAvx2Tiles * block_n);
  for (int64_t m0 = 0; m0 < p.m; m0 += kAvx2Tiles) {
    const int64_t rows = std::min<int64_t>(kAvx2Tiles, p.m - m0);
    std::fill(total, total + rows * block_n, 0.0f);
    // as many rows and spans per pass as the registers hold: a 64-block's two spans read its rows
    // in one pass where the rows allow (one stream), else one pass per span
    for (int64_t s0 = 0; s0 < spans;) {
      const int64_t together = std::min<int64_t>(spans - s0, std::max<int64_t>(1, kAvx2Tiles / rows));
      switch (rows * 4 + together) {  // rows x spans that fit (kAvx2Tiles 2: 1x2, 2x1; 4: up to 4x1, 2x2, 1x2)
        case 1 * 4 + 1: block_avx2<1, 1>(p, bytes, half, n0, m0, s0, total); break;
        case 1 * 4 + 2: block_avx2<1, 2>(p, bytes, half, n0, m0, s0, total); break;
        case 2 * 4 + 1: block_avx2<2, 1>(p, bytes, half, n0, m0, s0, total); break;
        case 2 * 4 + 2: block_avx2<2, 2>(p, bytes, half, n0, m0, s0, total); break;
        case 3 * 4 + 1: block_avx2<3, 1>(p, bytes, half, n0, m0, s0, total); break;
        default: block_avx2<4, 1>(p, bytes, half, n0, m0, s0, total); break;
      }
      s0 += together;
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < block_n; ++j) p.out[(m0 + r) * p.n + n0 + j] = float_to_bf16(total[r * block_n + j]);
  }
}
#endif  // LOWBIT_HAS_AVX2

// ---------------------------------------------------------------- AVX512-BF16 path (blocks of 64)
#if LOWBIT_HAS_AVX512BF16

// Rows per pass: 4 accumulators (64 outputs) per row stay in registers beside the shuffle constants.
constexpr int kTileRows = 4;

// bf16 values of the nibbles of a pair of inputs (k, k + 1) of a full block: the 64 contiguous bytes
// of rows k and k + 1. vpermb picks, for outputs j..j+15, byte j of each row into the low byte of
// alternating words (k, k+1, k, k+1, ...: the pairs vdpbf16ps and TDPBF16PS multiply); the nibble
// then becomes the mantissa of bf16 128 (0x4300 | u is exactly 128 + u), one bitwise op, so the
// sums carry 128 sum(a) extra, which the group's offset takes back (kBias).
struct Nibbles {
  __m512i pick0, pick1, low_nibble, bias;
  Nibbles() {
    alignas(64) static const uint8_t kPick[2][64] = {
        {0, 0, 32, 0, 1, 0, 33, 0, 2, 0, 34, 0, 3, 0, 35, 0, 4, 0, 36, 0, 5, 0, 37, 0,
         6, 0, 38, 0, 7, 0, 39, 0, 8, 0, 40, 0, 9, 0, 41, 0, 10, 0, 42, 0, 11, 0, 43, 0,
         12, 0, 44, 0, 13, 0, 45, 0, 14, 0, 46, 0, 15, 0, 47, 0},
        {16, 0, 48, 0, 17, 0, 49, 0, 18, 0, 50, 0, 19, 0, 51, 0, 20, 0, 52, 0, 21, 0, 53, 0,
         22, 0, 54, 0, 23, 0, 55, 0, 24, 0, 56, 0, 25, 0, 57, 0, 26, 0, 58, 0, 27, 0, 59, 0,
         28, 0, 60, 0, 29, 0, 61, 0, 30, 0, 62, 0, 31, 0, 63, 0}};
    pick0 = _mm512_load_si512(kPick[0]);
    pick1 = _mm512_load_si512(kPick[1]);
    low_nibble = _mm512_set1_epi16(0x000F);
    bias = _mm512_set1_epi16(0x4300);
  }
  // w[0..3]: outputs 0-15, 16-31, 32-47, 48-63 (low nibbles of bytes 0-15, 16-31, high of 0-15, 16-31)
  inline void pair(const uint8_t* bytes, __m512i* w) const {
    const __m512i v = _mm512_loadu_si512(bytes);
    const __mmask64 low_bytes = 0x5555555555555555ULL;
    const __m512i words0 = _mm512_maskz_permutexvar_epi8(low_bytes, pick0, v);
    const __m512i words1 = _mm512_maskz_permutexvar_epi8(low_bytes, pick1, v);
    w[0] = _mm512_ternarylogic_epi32(words0, low_nibble, bias, 0xEA);  // (words & 15) | 0x4300
    w[1] = _mm512_ternarylogic_epi32(words1, low_nibble, bias, 0xEA);
    w[2] = _mm512_or_si512(_mm512_srli_epi16(words0, 4), bias);
    w[3] = _mm512_or_si512(_mm512_srli_epi16(words1, 4), bias);
  }
};
constexpr float kBias = 128.0f + 8.0f;  // offset = z - kBias s: the nibbles' 128 and the format's 8
constexpr int64_t kPrefetchBytes = 2048;

// Rows m0 .. m0 + ROWS of one full block (outputs n0 .. n0 + 63), 4 accumulators per row in registers.
template <int ROWS>
void block64_avx512(const Problem& p, const uint8_t* bytes, int64_t n0, int64_t m0) {
  const Nibbles nibbles;
  const __m512i high_words = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t groups = p.k / p.group;

  __m512 total[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) total[r][j] = _mm512_setzero_ps();

  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t kk = g * p.group; kk < (g + 1) * p.group; kk += 2) {
      // 2 KB ahead (the next block follows this one): the hardware streamer stops at each 4 KB
      // page, and at one row too little work hides its restart (a prefetch never faults)
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kk * 32 + kPrefetchBytes), _MM_HINT_T0);
      __m512i w[4];
      nibbles.pair(bytes + kk * 32, w);
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;  // a[m, kk] and a[m, kk + 1], one bf16 pair
        std::memcpy(&pair, p.a + (m0 + r) * p.k + kk, 4);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)w[j], x);
      }
    }
    // total += s * acc + (z - kBias s) * sum(a over the group), (scale, zero) one bf16 pair per output
    const uint16_t* sz = p.scale_zeros + (g * p.n + n0) * 2;
    for (int j = 0; j < 4; ++j) {
      const __m512i pairs = _mm512_loadu_si512(sz + 32 * j);
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_words));
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(kBias), s, z);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 sums = _mm512_set1_ps(p.row_sums[(m0 + r) * groups + g]);
        total[r][j] = _mm512_fmadd_ps(offset, sums, _mm512_fmadd_ps(s, acc[r][j], total[r][j]));
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) {
      const __m256bh y = _mm512_cvtneps_pbh(total[r][j]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.out + (m0 + r) * p.n + n0 + 16 * j), (__m256i)y);
    }
}

void block64_all_rows(const Problem& p, const uint8_t* bytes, int64_t n0) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kTileRows) {
    switch (std::min<int64_t>(kTileRows, p.m - m0)) {
      case 1: block64_avx512<1>(p, bytes, n0, m0); break;
      case 2: block64_avx512<2>(p, bytes, n0, m0); break;
      case 3: block64_avx512<3>(p, bytes, n0, m0); break;
      default: block64_avx512<4>(p, bytes, n0, m0); break;
    }
  }
}

// ---------------------------------------------------------------- AMX path (blocks of 64)
#if LOWBIT_HAS_AMX
// Sapphire Rapids' tile unit: one TDPBF16PS multiplies up to 16 rows of 32 inputs by 16 outputs at
// a fixed cost, so rows beyond the first are nearly free. Per block and group, the nibbles become
// bf16 B tiles ([16 input pairs][16 outputs][2], the pairs Nibbles builds) in
// an L1 buffer once; each chunk of up to 16 rows then loads its A tile straight from `a`.

// The bf16 weights of one group of one block: B tile (step s, outputs 16 j..16 j+15) at
// out + (s * 4 + j) * 1024 bytes, row = input pair within the step.
void convert_group(const uint8_t* bytes, int64_t k0, int64_t group, uint8_t* out) {
  const Nibbles nibbles;
  for (int64_t pair = 0; pair < group / 2; ++pair) {
    const uint8_t* from = bytes + (k0 + 2 * pair) * 32;
    _mm_prefetch(reinterpret_cast<const char*>(from + kPrefetchBytes), _MM_HINT_T0);  // as block64_avx512
    __m512i w[4];
    nibbles.pair(from, w);
    uint8_t* row = out + (pair / 16) * 4096 + (pair % 16) * 64;
    for (int j = 0; j < 4; ++j) _mm512_store_si512(row + 1024 * j, w[j]);
  }
}

// total[r][0..63] += s * sums[r] + (z - kBias s) * row_sums[r, g] for the `rows` rows from `m0`.
void fold_group(const Problem& p, const float* sums, int64_t rows, int64_t m0, int64_t g, int64_t n0,
                           float* total) {
  const __m512i high_words = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t groups = p.k / p.group;
  const uint16_t* sz = p.scale_zeros + (g * p.n + n0) * 2;
  for (int j = 0; j < 4; ++j) {
    const __m512i pairs = _mm512_loadu_si512(sz + 32 * j);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(kBias), s,
                                           _mm512_castsi512_ps(_mm512_and_si512(pairs, high_words)));
    for (int64_t r = 0; r < rows; ++r) {
      float* t = total + (m0 + r) * 64 + 16 * j;
      const __m512 x = _mm512_set1_ps(p.row_sums[(m0 + r) * groups + g]);
      _mm512_storeu_ps(t, _mm512_fmadd_ps(offset, x, _mm512_fmadd_ps(s, _mm512_loadu_ps(sums + r * 64 + 16 * j),
                                                                      _mm512_loadu_ps(t))));
    }
  }
}

// Full blocks b0..b1 for all rows; `a` padded to a multiple of `tile_rows` rows (a_rows of them).
void blocks_amx(const Problem& p, const uint16_t* a, int64_t tile_rows, int64_t b0, int64_t b1) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = static_cast<uint8_t>(tile_rows);  // tmm0-3 sums, tmm4 activations
    config.colsb[t] = 64;
  }
  for (int t = 5; t < 7; ++t) {
    config.rows[t] = 16;  // tmm5-6 weights
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  alignas(64) uint8_t weights[kMaxGroup / 32 * 4096];
  alignas(64) float sums[16 * 64];
  thread_local std::vector<float> total_buffer;  // this thread's, kept between calls
  float* total = at_least(total_buffer, p.m * 64);
  const int64_t groups = p.k / p.group, stride = p.k * 2;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * 64;
    const uint8_t* bytes = p.packed + n0 * p.k / 2;
    std::fill(total, total + p.m * 64, 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      convert_group(bytes, g * p.group, p.group, weights);
      for (int64_t m0 = 0; m0 < p.m; m0 += tile_rows) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t step = 0; step < p.group / 32; ++step) {
          _tile_loadd(4, a + m0 * p.k + g * p.group + step * 32, stride);
          const uint8_t* w = weights + step * 4096;
          _tile_loadd(5, w, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, w + 1024, 64);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, w + 2048, 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(6, w + 3072, 64);
          _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, sums, 256);
        _tile_stored(1, sums + 16, 256);
        _tile_stored(2, sums + 32, 256);
        _tile_stored(3, sums + 48, 256);
        fold_group(p, sums, std::min(tile_rows, p.m - m0), m0, g, n0, total);
      }
    }
    for (int64_t r = 0; r < p.m; ++r)
      for (int j = 0; j < 4; ++j) {
        const __m256bh y = _mm512_cvtneps_pbh(_mm512_loadu_ps(total + r * 64 + 16 * j));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.out + r * p.n + n0 + 16 * j), (__m256i)y);
      }
  }
  _tile_release();
}
#endif  // LOWBIT_HAS_AMX
#endif  // LOWBIT_HAS_AVX512BF16

// ---------------------------------------------------------------- entry

// The calling thread's buffers, grown to the largest call and kept: a decode step makes 120 calls, and
// a heap allocation (or an ATen op) per call cost as much as a small layer's product
struct Buffers {
  std::vector<uint16_t> a, out;
  std::vector<float> a_float, row_sums;
};

// The rows of `x` (float32 or bf16 [M, K], contiguous) in bf16, as x.to(bfloat16) rounds them (c10's
// nearest even), zero-padded to `padded` rows (AMX's whole chunks); their sums per group, and in
// float where the portable loop runs (`floats`), into `b`. Returns the bf16 rows (x's own when bf16
// and unpadded).
const uint16_t* activations(const at::Tensor& x, int64_t m, int64_t k, int64_t group, int64_t padded,
                            bool floats, Buffers& b, float** a_float, float** row_sums) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const uint16_t* a = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  if (!bf16 || padded > m) {
    uint16_t* rows = at_least(b.a, padded * k);
    if (bf16) {
      std::memcpy(rows, a, m * k * sizeof(uint16_t));
    } else {
      const float* from = x.data_ptr<float>();
      for (int64_t i = 0; i < m * k; ++i) rows[i] = float_to_bf16(from[i]);
    }
    std::fill(rows + m * k, rows + padded * k, uint16_t{0});
    a = rows;
  }
  float* sums = at_least(b.row_sums, m * (k / group));
  std::fill(sums, sums + m * (k / group), 0.0f);
  float* as_float = floats ? at_least(b.a_float, m * k) : nullptr;
  for (int64_t i = 0; i < m * k; ++i) {  // in order, one group after the other (the sums' rounding)
    const float v = bf16_to_float(a[i]);
    if (floats) as_float[i] = v;
    sums[i / group] += v;
  }
  *a_float = as_float;
  *row_sums = sums;
  return a;
}

// x @ w.T for `x` float32 or bf16 [..., K] (1..kMaxRows rows): bf16 sums rounded once, returned in
// x's dtype ([..., N]; float32 holds the bf16 values, as x.to(bf16) @ ... then .to(float32) would).
// Blocks of outputs split across threads only in spans of at least `parallel_bytes` packed bytes:
// waking a second thread costs more than a small layer's whole product on a decode step.
at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t group,
                          const at::Tensor& scale_zeros, int64_t block_n, bool halves, int64_t path,
                          int64_t parallel_bytes) {
  TORCH_CHECK((x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat) && x_in.dim() >= 1,
              "x: a float32 or bf16 [..., K] tensor");
  TORCH_CHECK(packed.dtype() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed: a contiguous uint8 [N, K/2] tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(x.size(-1) == k, "x has ", x.size(-1), " inputs, the weight ", k);
  const int64_t m = x.numel() / k;
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "rows must be 1..", kMaxRows, ", got ", m);
  TORCH_CHECK(block_n > 0 && block_n <= kMaxBlock && block_n % 2 == 0 && n % 2 == 0, "block_n and N must be even, block_n <= 64");
  TORCH_CHECK(group >= 2 && group % 2 == 0 && k % group == 0, "group must be even and divide K = ", k);
  TORCH_CHECK(scale_zeros.dtype() == at::kBFloat16 && scale_zeros.is_contiguous() &&
                  scale_zeros.sizes() == at::IntArrayRef({k / group, n, 2}),
              "scale_zeros: a contiguous bf16 [K/group, N, 2] tensor");
  TORCH_CHECK(path >= kPortable && path <= best_path(), "path ", path, " cannot run here (best: ", best_path(), ")");
  // AVX512-BF16 and AMX read AVX-512's blocks of 64, AVX2 those and AVX2's blocks of 32 (`halves`
  // both); the portable loop any block, and every partial last block
  if (path >= kAvx512 && !(block_n == 64 && halves)) path = LOWBIT_HAS_AVX2 ? kAvx2 : kPortable;
  if (path == kAvx2 && !((block_n == 64 || block_n == 32) && halves)) path = kPortable;
  if (path == kAmx && (group % 32 || group > kMaxGroup)) path = kAvx512;
  const int64_t blocks = (n + block_n - 1) / block_n, full = path == kPortable ? 0 : n / block_n;
  // AMX: chunks of up to 16 rows, the activations zero-padded to whole chunks
  const int64_t tile_rows = std::min<int64_t>(m, 16);
  const int64_t padded = path == kAmx ? (m + tile_rows - 1) / tile_rows * tile_rows : m;

  thread_local Buffers buffers;
  float *a_float, *row_sums;
  const bool floats = full < blocks || path == kAvx2;  // the portable and AVX2 paths read float rows
  const uint16_t* a = activations(x, m, k, group, padded, floats, buffers, &a_float, &row_sums);
  at::DimVector shape(x.sizes());  // inline storage: no heap allocation
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  const bool widen = x.scalar_type() == at::kFloat;  // bf16 sums first, then float32 (x's dtype)
  uint16_t* out_bits = widen ? at_least(buffers.out, m * n) : reinterpret_cast<uint16_t*>(out.data_ptr());
  const Problem p{a, a_float, row_sums, packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale_zeros.data_ptr()),
                  out_bits, m, n, k, group};
  const int64_t block_bytes = block_n * k / 2;
  const int64_t grain = std::max<int64_t>(1, (parallel_bytes + block_bytes - 1) / block_bytes);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t vector_end = std::min(b1, full);
#if LOWBIT_HAS_AMX
    if (path == kAmx && b0 < vector_end) blocks_amx(p, a, tile_rows, b0, vector_end);
#endif
#if LOWBIT_HAS_AVX512BF16
    if (path == kAvx512)
      for (int64_t b = b0; b < vector_end; ++b) block64_all_rows(p, p.packed + b * 64 * k / 2, b * 64);
#endif
#if LOWBIT_HAS_AVX2
    if (path == kAvx2)
      for (int64_t b = b0; b < vector_end; ++b)
        block_avx2_all_rows(p, p.packed + b * block_n * k / 2, block_n, b * block_n);
#endif
    b0 = std::max(b0, vector_end);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * block_n;
      block_portable(p, p.packed + n0 * k / 2, n0, b < n / block_n ? block_n : n - n0, b < n / block_n && halves);
    }
  });
  if (widen) {
    float* y = out.data_ptr<float>();
    for (int64_t i = 0; i < m * n; ++i) y[i] = bf16_to_float(out_bits[i]);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "x @ w.T for Int4Slots' packed weight, [..., N] in x's dtype (float32 or bf16)",
        py::arg("x"), py::arg("packed"), py::arg("group"), py::arg("scale_zeros"), py::arg("block_n"),
        py::arg("halves"), py::arg("path"), py::arg("parallel_bytes"));
  m.def("best_path", &best_path, "the fastest path of this build here: 0 portable, 1 AVX2, 2 AVX512-BF16, 3 AMX");
  m.def("level", &build_level, "the instruction-set level this build was compiled for");
}
