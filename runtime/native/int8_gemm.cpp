// A CPU 8-bit per-channel weight-only matmul for few activation rows (decode at batch 1-32, short
// prompts), reading the weights of runtime/cpu_linear.py's Int8Channels as they are (no second copy):
// y = (a @ q.T) * scales.
//
// Why: aten._weight_int8pack_mm turns every code into a float and multiplies it by each row with
// float FMAs: compute-bound, its time grows linearly with the rows (8192x2048 on a Sapphire Rapids
// core: 1.7 ms at one row, 5.4 ms at eight, 23.6 ms at 32), where a dense bf16 matmul barely grows.
// Here the codes become bf16 (|q| <= 128 is exact in bf16) once per call, the products are bf16 dot
// products with float sums (AMX tiles, or vdpbf16ps), and the scale is applied once per output after
// the sum over all inputs (per-channel: one scale per output).
//
// Input: `a` bf16 [M, K] contiguous; `q` int8 [N, K] contiguous (one output per row); `scales` bf16
// [N]. Any K and N (partial tiles are zero-padded). Output: bf16 [M, N], the float32 sum times the
// scale rounded once to nearest even, as aten's.
//
// Paths: AMX (weights as the A tiles in their own row order, the activations as the B tiles, so only
// the small activations are rearranged, and the [outputs, rows] sums are transposed once at the end);
// float dot products along K with AVX512 (one row), or AVX2's 8 lanes; a portable loop. Each in the
// builds of the levels that have its instructions (common.h's LOWBIT_HAS_*), as int4_gemm.cpp's.
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

constexpr int64_t kMaxRows = 256;  // rows per call (runtime/cpu_int8_gemm.py takes fewer)

struct Problem {
  const uint16_t* a;       // bf16 [M, K]
  const int8_t* q;         // [N, K]
  const uint16_t* scales;  // bf16 [N]
  uint16_t* out;           // bf16 [M, N]
  int64_t m, n, k;
};

// ---------------------------------------------------------------- portable path

// Outputs [n0, n1) for all rows.
void outputs_portable(const Problem& p, int64_t n0, int64_t n1) {
  std::vector<float> a_float(p.k);
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t kk = 0; kk < p.k; ++kk) a_float[kk] = bf16_to_float(p.a[r * p.k + kk]);
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* w = p.q + n * p.k;
      float sum = 0.0f;
      for (int64_t kk = 0; kk < p.k; ++kk) sum += a_float[kk] * static_cast<float>(w[kk]);
      p.out[r * p.n + n] = float_to_bf16(sum * bf16_to_float(p.scales[n]));
    }
  }
}

#if LOWBIT_HAS_AVX2
// ---------------------------------------------------------------- AVX2 path (dot products along K)
// The AVX512 path's float dot products in 8 lanes, for the levels without AVX512-BF16: per 8 codes
// one widening load and a convert, shared by 4 outputs' rows; 2 rows per pass (4 with AVX-512's 32
// registers) keep the accumulators in registers. The last K % 8 inputs are summed one by one.
constexpr int kAvx2Outs = 4;
constexpr int kAvx2Rows = LOWBIT_HAS_AVX512 ? 4 : 2;

inline float lanes_sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int ROWS, int OUTS>
void dot_avx2(const Problem& p, const float* a_float, int64_t n0, int64_t m0) {
  __m256 acc[ROWS][OUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm256_setzero_ps();
  const int64_t whole = p.k / 8 * 8;
  for (int64_t k0 = 0; k0 < whole; k0 += 8) {
    __m256 w[OUTS];
    for (int o = 0; o < OUTS; ++o)
      w[o] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q + (n0 + o) * p.k + k0))));
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x = _mm256_loadu_ps(a_float + (m0 + r) * p.k + k0);
      for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm256_fmadd_ps(w[o], x, acc[r][o]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) {
      float sum = lanes_sum8(acc[r][o]);
      for (int64_t kk = whole; kk < p.k; ++kk) sum += a_float[(m0 + r) * p.k + kk] * static_cast<float>(p.q[(n0 + o) * p.k + kk]);
      p.out[(m0 + r) * p.n + n0 + o] = float_to_bf16(sum * bf16_to_float(p.scales[n0 + o]));
    }
}

template <int OUTS>
void dot_avx2_all_rows(const Problem& p, const float* a_float, int64_t n0) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kAvx2Rows) {
    switch (std::min<int64_t>(kAvx2Rows, p.m - m0)) {
      case 1: dot_avx2<1, OUTS>(p, a_float, n0, m0); break;
      case 2: dot_avx2<2, OUTS>(p, a_float, n0, m0); break;
      case 3: dot_avx2<3, OUTS>(p, a_float, n0, m0); break;
      default: dot_avx2<4, OUTS>(p, a_float, n0, m0); break;
    }
  }
}

void outputs_avx2(const Problem& p, const float* a_float, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kAvx2Outs <= n1; n += kAvx2Outs) dot_avx2_all_rows<kAvx2Outs>(p, a_float, n);
  for (; n < n1; ++n) dot_avx2_all_rows<1>(p, a_float, n);
}
#endif  // LOWBIT_HAS_AVX2

#if LOWBIT_HAS_AVX512BF16

// 32 codes (bytes; those past `valid` read as 0) as 32 exact bf16 values, in order.
inline __m512bh codes_to_bf16(const int8_t* src, __mmask32 valid) {
  const __m256i bytes = _mm256_maskz_loadu_epi8(valid, src);
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(high, low);  // the second operand fills the low half
}

inline __mmask32 first(int64_t count) { return count >= 32 ? ~0u : (1u << count) - 1; }

// ---------------------------------------------------------------- AVX512 path (dot products along K)
// For one or two rows float FMAs beat bf16 dot products: a code becomes a float in two ops
// (vpmovsxbd, vcvtdq2ps) and one FMA uses it, where the bf16 pair costs a pack (vcvtne2ps2bf16,
// two uops) more per 32 codes; that pack pays off only when many rows share it (the AMX path).
constexpr int kOuts = 4;  // outputs per pass: their converted codes are shared by every row

// Outputs n0 .. n0 + OUTS, rows m0 .. m0 + ROWS: ROWS x OUTS float accumulators over K, reduced at
// the end. `a_float`: the activations as floats [M, K].
template <int ROWS, int OUTS>
void dot_avx512(const Problem& p, const float* a_float, int64_t n0, int64_t m0) {
  __m512 acc[ROWS][OUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.k; k0 += 16) {
    const __mmask16 valid = p.k - k0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (p.k - k0)) - 1);
    __m512 w[OUTS];
    for (int o = 0; o < OUTS; ++o)
      w[o] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(valid, p.q + (n0 + o) * p.k + k0)));
    for (int r = 0; r < ROWS; ++r) {
      const __m512 x = _mm512_maskz_loadu_ps(valid, a_float + (m0 + r) * p.k + k0);
      for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_fmadd_ps(w[o], x, acc[r][o]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o)
      p.out[(m0 + r) * p.n + n0 + o] = float_to_bf16(_mm512_reduce_add_ps(acc[r][o]) * bf16_to_float(p.scales[n0 + o]));
}

template <int OUTS>
void dot_all_rows(const Problem& p, const float* a_float, int64_t n0) {
  for (int64_t m0 = 0; m0 < p.m; m0 += 4) {
    switch (std::min<int64_t>(4, p.m - m0)) {
      case 1: dot_avx512<1, OUTS>(p, a_float, n0, m0); break;
      case 2: dot_avx512<2, OUTS>(p, a_float, n0, m0); break;
      case 3: dot_avx512<3, OUTS>(p, a_float, n0, m0); break;
      default: dot_avx512<4, OUTS>(p, a_float, n0, m0); break;
    }
  }
}

void outputs_avx512(const Problem& p, const float* a_float, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kOuts <= n1; n += kOuts) dot_all_rows<kOuts>(p, a_float, n);
  for (; n < n1; ++n) dot_all_rows<1>(p, a_float, n);
}

// ---------------------------------------------------------------- AMX path (blocks of 64 outputs)
#if LOWBIT_HAS_AMX
// Sapphire Rapids' tile unit: one TDPBF16PS multiplies 16 rows of 32 inputs by 16 columns at a fixed
// cost. The weights' own layout, q[n, k..k+31] per row, is an A tile (16 outputs x 32 inputs) once
// converted to bf16; the activations, rearranged once per call into input pairs x 16 rows x 2 (the
// B tile layout), are the other operand. The sums come out [outputs, rows] and are transposed when
// scaled. Per block of 64 outputs and chunk of kChunk inputs, the codes are converted into an L1
// buffer once and used by every chunk of 16 rows.

constexpr int64_t kChunk = 256;  // inputs per conversion: 64 outputs x 256 bf16 = 32 KB, in L1

// The bf16 codes of outputs n0 .. n0 + 63 (rows past N zero), inputs k0 .. k0 + kChunk (past K zero):
// A tile (step s, outputs 16 j .. 16 j + 15) at out + (s * 4 + j) * 512 values, 32 per output.
void convert_chunk(const Problem& p, int64_t n0, int64_t k0, int64_t steps, uint16_t* out) {
  for (int64_t o = 0; o < 64; ++o) {
    const int8_t* row = p.q + (n0 + o) * p.k;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k = k0 + 32 * s;
      const __m512bh w = n0 + o < p.n ? codes_to_bf16(row + k, first(p.k - k)) : (__m512bh)_mm512_setzero_si512();
      _mm512_store_si512(out + (s * 4 + o / 16) * 512 + (o % 16) * 32, (__m512i)w);
    }
    // 64 rows 2 KB+ apart are more streams than the hardware prefetcher follows (without this the
    // path ran at half speed): fetch this row's next chunk, or after the last the next block's first
    const bool last = k0 + kChunk >= p.k;
    const int8_t* next = last ? row + 64 * p.k : row + k0 + kChunk;
    if (n0 + o + (last ? 64 : 0) < p.n)
      for (int64_t k = 0; k < std::min(kChunk, last ? p.k : p.k - k0 - kChunk); k += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + k), _MM_HINT_T0);
  }
}

// out[m0 + r, n0 .. n0 + 63] = bf16(sums[j][i][r] * scale) for the `rows` rows of one chunk, sums
// [4 tiles][16 outputs][16 rows]: each row's 16 outputs of a tile are one gather.
void store_rows(const Problem& p, const float* sums, int64_t rows, int64_t m0, int64_t n0) {
  const __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int j = 0; j < 4; ++j) {
    const int64_t first_out = n0 + 16 * j;
    if (first_out >= p.n) break;
    const __mmask16 valid = p.n - first_out >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (p.n - first_out)) - 1);
    const __m512 scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, p.scales + first_out)), 16));
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 y = _mm512_mul_ps(_mm512_i32gather_ps(across, sums + j * 256 + r, 4), scale);
      _mm256_mask_storeu_epi16(p.out + (m0 + r) * p.n + first_out, valid, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

// Blocks b0..b1 of 64 outputs for all rows; `b` the activations as B tiles: per chunk of 16 rows,
// [K padded to 32 / 2 pairs][16 rows][2].
void blocks_amx(const Problem& p, const uint16_t* b, int64_t k_padded, int64_t b0, int64_t b1) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {  // tmm0-3 sums [16 outputs][16 rows], tmm4-6 codes, tmm7 activations
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  alignas(64) uint16_t codes[kChunk / 32 * 4 * 512];
  const int64_t chunks = (p.m + 15) / 16, spans = (k_padded + kChunk - 1) / kChunk;
  std::vector<float> sums(chunks * 4 * 256);  // [chunk][tile][16 outputs][16 rows]
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t n0 = blk * 64;
    for (int64_t span = 0; span < spans; ++span) {
      const int64_t k0 = span * kChunk, steps = std::min(kChunk, k_padded - k0) / 32;
      convert_chunk(p, n0, k0, steps, codes);
      for (int64_t c = 0; c < chunks; ++c) {
        float* c_sums = sums.data() + c * 1024;
        // one chunk of rows keeps its sums in the tiles across spans; several store and reload them
        if (span == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else if (chunks > 1) {
          _tile_loadd(0, c_sums, 64);
          _tile_loadd(1, c_sums + 256, 64);
          _tile_loadd(2, c_sums + 512, 64);
          _tile_loadd(3, c_sums + 768, 64);
        }
        const uint16_t* acts = b + c * k_padded * 16 + k0 * 16;
        for (int64_t s = 0; s < steps; ++s) {
          _tile_loadd(7, acts + s * 512, 64);
          const uint16_t* w = codes + s * 2048;
          _tile_loadd(4, w, 64);
          _tile_dpbf16ps(0, 4, 7);
          _tile_loadd(5, w + 512, 64);
          _tile_dpbf16ps(1, 5, 7);
          _tile_loadd(6, w + 1024, 64);
          _tile_dpbf16ps(2, 6, 7);
          _tile_loadd(4, w + 1536, 64);
          _tile_dpbf16ps(3, 4, 7);
        }
        if (span == spans - 1 || chunks > 1) {
          _tile_stored(0, c_sums, 64);
          _tile_stored(1, c_sums + 256, 64);
          _tile_stored(2, c_sums + 512, 64);
          _tile_stored(3, c_sums + 768, 64);
        }
      }
    }
    for (int64_t c = 0; c < chunks; ++c) store_rows(p, sums.data() + c * 1024, std::min<int64_t>(16, p.m - 16 * c), 16 * c, n0);
  }
  _tile_release();
}

// The activations as B tiles (see blocks_amx), zero-padded to whole chunks of 16 rows and 32 inputs.
std::vector<uint16_t> activation_tiles(const Problem& p, int64_t k_padded) {
  const int64_t chunks = (p.m + 15) / 16;
  std::vector<uint16_t> b(chunks * k_padded * 16, 0);
  for (int64_t r = 0; r < p.m; ++r) {
    uint16_t* dst = b.data() + (r / 16) * k_padded * 16 + (r % 16) * 2;
    const uint16_t* src = p.a + r * p.k;
    for (int64_t kk = 0; kk < p.k; ++kk) dst[(kk / 2) * 32 + (kk % 2)] = src[kk];
  }
  return b;
}

#endif  // LOWBIT_HAS_AMX
#endif  // LOWBIT_HAS_AVX512BF16

// ---------------------------------------------------------------- entry

at::Tensor int8_matmul(const at::Tensor& a, const at::Tensor& q, const at::Tensor& scales, int64_t path) {
  TORCH_CHECK(a.dtype() == at::kBFloat16 && a.dim() == 2 && a.is_contiguous(), "a: a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(q.dtype() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q: a contiguous int8 [N, K] tensor");
  const int64_t m = a.size(0), n = q.size(0), k = q.size(1);
  TORCH_CHECK(a.size(1) == k, "a has ", a.size(1), " inputs, the weight ", k);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "rows must be 1..", kMaxRows, ", got ", m);
  TORCH_CHECK(k >= 1 && n >= 1, "an empty weight");
  TORCH_CHECK(scales.dtype() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == n,
              "scales: a contiguous bf16 tensor of N = ", n, " values");
  TORCH_CHECK(path >= kPortable && path <= best_path(), "path ", path, " cannot run here (best: ", best_path(), ")");
  at::Tensor out = at::empty({m, n}, a.options());
  const Problem p{reinterpret_cast<const uint16_t*>(a.data_ptr()), q.data_ptr<int8_t>(),
                  reinterpret_cast<const uint16_t*>(scales.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                  m, n, k};
#if LOWBIT_HAS_AMX
  if (path == kAmx) {
    const int64_t k_padded = (k + 31) / 32 * 32;
    const std::vector<uint16_t> b = activation_tiles(p, k_padded);
    at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t b0, int64_t b1) { blocks_amx(p, b.data(), k_padded, b0, b1); });
    return out;
  }
#endif
#if LOWBIT_HAS_AVX2
  if (path == kAvx512 || path == kAvx2) {  // the one float conversion both dot-product paths read
    std::vector<float> a_float(m * k);
    for (int64_t i = 0; i < m * k; ++i) a_float[i] = bf16_to_float(p.a[i]);
#if LOWBIT_HAS_AVX512BF16
    if (path == kAvx512) {
      at::parallel_for(0, (n + kOuts - 1) / kOuts, 16, [&](int64_t b0, int64_t b1) {
        outputs_avx512(p, a_float.data(), b0 * kOuts, std::min(n, b1 * kOuts));
      });
      return out;
    }
#endif
    at::parallel_for(0, (n + kAvx2Outs - 1) / kAvx2Outs, 16, [&](int64_t b0, int64_t b1) {
      outputs_avx2(p, a_float.data(), b0 * kAvx2Outs, std::min(n, b1 * kAvx2Outs));
    });
    return out;
  }
#endif
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) { outputs_portable(p, n0, n1); });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_matmul", &int8_matmul, "(a @ q.T) * scales for Int8Channels' weight, bf16 [M, N]", py::arg("a"),
        py::arg("q"), py::arg("scales"), py::arg("path"));
  m.def("best_path", &best_path, "the fastest path of this build here: 0 portable, 1 AVX2, 2 AVX512, 3 AMX");
  m.def("level", &build_level, "the instruction-set level this build was compiled for");
}
