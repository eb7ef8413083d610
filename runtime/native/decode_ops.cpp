// A CPU decode step's small work on few rows, each one call instead of a chain of ATen ops
// (runtime/decode_ops.py says where each runs; the PyTorch code there is the reference).
//
// Why: at batch 1 a SmolLM2 step spent a third of its time outside the quantized Linears, in ops of
// a few microseconds each on [1, 576] tensors (dispatch, allocation, Python), and lm_head's bf16
// matrix-vector product read its 57 MB at ~11 GB/s (bench/results/cpu/NOTES.md).
//
// * bf16_gemv: y[m, n] = sum_k w[n, k] a[m, k] for a bf16 weight [N, K] and 1-4 rows, the rows
//   rounded to bf16 once (as the PyTorch path's conversion), float32 sums returned unrounded;
//   AVX512-BF16 dot products, four weight rows at a time, prefetching ahead of the stream.
// * add_rms_norm: s = x + residual (residual optional), out = s / sqrt(mean(s^2) + eps) * weight,
//   float32 rows; returns out and s.
// * silu_mul: [..., 2W] -> [..., W], silu(gate) * up; bf16 rounds silu's result before the product
//   and the product (as the two PyTorch ops do), float32 computes in float32.
// * rope_qk: RoPE of the q and k heads of a joined projection [B, T, (Hq + 2 Hk) D] (float32) into
//   [B, T, Hq + Hk, D]: x * cos + rotate_half(x) * sin, each product and the sum rounded as the
//   PyTorch ops do (no fused multiply-add), so bit for bit the reference.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: all of libtorch's headers, a minute to build
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kMaxGemvRows = 4;
constexpr int64_t kPrefetchBytes = 4096;  // ahead in the weight stream (one row of 576 bf16 is 1152 bytes)

#if LOWBIT_HAS_AVX512BF16
// y[r, n0 .. n0 + NB) for ROWS rows: NB weight rows at a time, K in steps of 32 (the tail masked)
template <int ROWS, int NB>
void gemv_block(const uint16_t* w, const uint16_t* a, int64_t k, int64_t n, int64_t n0,
                                  float* y) {
  __m512 acc[ROWS][NB];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* rows = w + n0 * k;
  for (int64_t kk = 0; kk < k; kk += 32) {
    const __mmask32 mask = k - kk >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - kk)) - 1;
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      const uint16_t* from = rows + j * k + kk;
      _mm_prefetch(reinterpret_cast<const char*>(from) + kPrefetchBytes, _MM_HINT_T0);
      wv[j] = _mm512_maskz_loadu_epi16(mask, from);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512i x = _mm512_maskz_loadu_epi16(mask, a + r * k + kk);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[j], (__m512bh)x);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < NB; ++j) y[r * n + n0 + j] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int ROWS>
void gemv_range(const uint16_t* w, const uint16_t* a, int64_t k, int64_t n, int64_t n0,
                                  int64_t n1, float* y) {
  int64_t i = n0;
  for (; i + 4 <= n1; i += 4) gemv_block<ROWS, 4>(w, a, k, n, i, y);
  for (; i < n1; ++i) gemv_block<ROWS, 1>(w, a, k, n, i, y);
}
#endif

// The rows as bf16 (round to nearest even, as a PyTorch conversion), or their own bf16 bits
std::vector<uint16_t> rows_as_bf16(const at::Tensor& a) {
  std::vector<uint16_t> out(a.numel());
  if (a.scalar_type() == at::kBFloat16) {
    std::memcpy(out.data(), a.data_ptr(), out.size() * 2);
  } else {
    const float* x = a.data_ptr<float>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = float_to_bf16(x[i]);
  }
  return out;
}

at::Tensor bf16_gemv(const at::Tensor& weight, const at::Tensor& a_in) {
  const at::Tensor a = a_in.contiguous();
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "weight: a contiguous bf16 [N, K] tensor");
  TORCH_CHECK((a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) && a.dim() == 2 &&
                  a.size(1) == weight.size(1) && a.size(0) >= 1 && a.size(0) <= kMaxGemvRows,
              "a: a float32 or bf16 [M, K] tensor, 1 <= M <= ", kMaxGemvRows, ", K = ", weight.size(1));
  TORCH_CHECK(LOWBIT_HAS_AVX512BF16, "bf16_gemv needs AVX512-BF16 (this build's level: ", build_level(),
              "; gemv_usable() says whether it runs)");
  const int64_t m = a.size(0), k = a.size(1), n = weight.size(0);
  const std::vector<uint16_t> rows = rows_as_bf16(a);
  at::Tensor y = at::empty({m, n}, a.options().dtype(at::kFloat));
#if LOWBIT_HAS_AVX512BF16
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  float* out = y.data_ptr<float>();
  const uint16_t* x = rows.data();
  const auto outputs = [&](int64_t n0, int64_t n1) {
    switch (m) {
      case 1: gemv_range<1>(w, x, k, n, n0, n1, out); break;
      case 2: gemv_range<2>(w, x, k, n, n0, n1, out); break;
      case 3: gemv_range<3>(w, x, k, n, n0, n1, out); break;
      default: gemv_range<4>(w, x, k, n, n0, n1, out); break;
    }
  };
  if (n < 4) {
    outputs(0, n);
  } else {  // blocks of four outputs; the last range also takes N % 4
    at::parallel_for(0, n / 4, 256, [&](int64_t b0, int64_t b1) { outputs(b0 * 4, b1 == n / 4 ? n : b1 * 4); });
  }
#endif
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual_in,
                                                const at::Tensor& weight, double eps) {
  const at::Tensor x = x_in.contiguous();  // a view of the last position (Decoder.forward's last_only)
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: a float32 tensor");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == h,
              "weight: a contiguous float32 [", h, "] tensor");
  at::Tensor sum = x, residual;
  if (residual_in.has_value()) {
    residual = residual_in->contiguous();
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.sizes() == x.sizes(),
                "residual: a float32 tensor of x's shape");
    sum = at::empty(x.sizes(), x.options());
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* px = x.data_ptr<float>();
  const float* pr = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const float* pw = weight.data_ptr<float>();
  float* ps = sum.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {  // prefill's many rows; decode's few run inline
    for (int64_t r = r0; r < r1; ++r) {
      float* sr = ps + r * h;
      if (pr != nullptr)
        for (int64_t i = 0; i < h; ++i) sr[i] = px[r * h + i] + pr[r * h + i];
      float squares = 0.0f;
      for (int64_t i = 0; i < h; ++i) squares += sr[i] * sr[i];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(h) + feps);
      float* o = po + r * h;
      for (int64_t i = 0; i < h; ++i) o[i] = sr[i] * inv * pw[i];
    }
  });
  return {out, sum};
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

#if LOWBIT_HAS_AVX512BF16
// exp(x) for |x| < 87 (silu's gate clamps there: the sigmoid is 0 or 1 to float precision), the
// Cephes polynomial on x - n ln 2 (within 2 ulp of expf); libm's expf does not vectorize here
inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(87.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 silu_avx512(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

// one row: 16 at a time, the tail masked
void silu_mul_row_f32(const float* g, const float* u, int64_t width, float* o) {
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 mask = width - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - i)) - 1);
    const __m512 s = silu_avx512(_mm512_maskz_loadu_ps(mask, g + i));
    _mm512_mask_storeu_ps(o + i, mask, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mask, u + i)));
  }
}

inline __m512 bf16x16_to_float(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

void silu_mul_row_bf16(const uint16_t* g, const uint16_t* u, int64_t width, uint16_t* o) {
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 mask = width - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - i)) - 1);
    const __m512 gf = bf16x16_to_float(_mm256_maskz_loadu_epi16(mask, g + i));
    const __m512 uf = bf16x16_to_float(_mm256_maskz_loadu_epi16(mask, u + i));
    // silu rounded to bf16 (PyTorch's silu returns bf16), then the product rounded
    const __m512 s = bf16x16_to_float((__m256i)_mm512_cvtneps_pbh(silu_avx512(gf)));
    _mm256_mask_storeu_epi16(o + i, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, uf)));
  }
}
#elif LOWBIT_HAS_AVX2
// The same in 8 lanes (the same operations, so the same values: 2^n as an exponent field multiplies
// exactly as scalef does for these n); a row's tail through a zero-padded vector
inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(87.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));  // |n| <= 126: a normal power of two
}

inline __m256 silu_avx2(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// 8 floats to bf16 bits, nearest even (float_to_bf16_finite's formula)
inline __m128i float8_to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

inline __m256 bf16x8_to_float(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <class T>
void silu_mul_tail(const T* g, const T* u, int64_t count, T* o, void (*row)(const T*, const T*, int64_t, T*)) {
  T gt[8] = {}, ut[8] = {}, ot[8];
  std::memcpy(gt, g, count * sizeof(T));
  std::memcpy(ut, u, count * sizeof(T));
  row(gt, ut, 8, ot);
  std::memcpy(o, ot, count * sizeof(T));
}

void silu_mul_row_f32(const float* g, const float* u, int64_t width, float* o) {
  const int64_t whole = width / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8)
    _mm256_storeu_ps(o + i, _mm256_mul_ps(silu_avx2(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
  if (whole < width) silu_mul_tail<float>(g + whole, u + whole, width - whole, o + whole, silu_mul_row_f32);
}

void silu_mul_row_bf16(const uint16_t* g, const uint16_t* u, int64_t width, uint16_t* o) {
  const int64_t whole = width / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 gf = bf16x8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i)));
    const __m256 uf = bf16x8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + i)));
    const __m256 s = bf16x8_to_float(float8_to_bf16(silu_avx2(gf)));  // silu rounded first, as PyTorch's
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), float8_to_bf16(_mm256_mul_ps(s, uf)));
  }
  if (whole < width) silu_mul_tail<uint16_t>(g + whole, u + whole, width - whole, o + whole, silu_mul_row_bf16);
}
#endif
#define LOWBIT_SILU_VECTORS (LOWBIT_HAS_AVX512BF16 || LOWBIT_HAS_AVX2)

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = gate_up_in.contiguous();
  TORCH_CHECK((gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16) &&
                  gate_up.size(-1) % 2 == 0,
              "gate_up: a float32 or bf16 [..., 2W] tensor");
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / std::max<int64_t>(2 * width, 1);
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    const float* in = gate_up.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = in + r * 2 * width;
#if LOWBIT_SILU_VECTORS
      silu_mul_row_f32(g, g + width, width, o + r * width);
      continue;
#endif
      for (int64_t i = 0; i < width; ++i) o[r * width + i] = silu(g[i]) * g[width + i];
    }
  } else {
    const auto* in = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
    auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* g = in + r * 2 * width;
#if LOWBIT_SILU_VECTORS
      silu_mul_row_bf16(g, g + width, width, o + r * width);
      continue;
#endif
      for (int64_t i = 0; i < width; ++i) {
        const float s = bf16_to_float(float_to_bf16_finite(silu(bf16_to_float(g[i]))));
        o[r * width + i] = float_to_bf16_finite(s * bf16_to_float(g[width + i]));
      }
    }
  }
  return out;
}

// One head of D values: x * cos + cat(-x2, x1) * sin, each product rounded before the sum (no FMA,
// as three PyTorch ops round)
__attribute__((optimize("fp-contract=off"))) void rope_head(const float* x, const float* c, const float* s,
                                                             int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j] * c[j], b = -x[j + half] * s[j];
    out[j] = a + b;
  }
  for (int64_t j = half; j < d; ++j) {
    const float a = x[j] * c[j], b = x[j - half] * s[j];
    out[j] = a + b;
  }
}

at::Tensor rope_qk(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t hq,
                   int64_t hk) {
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 3,
              "qkv: a float32 [B, T, (Hq + 2 Hk) D] tensor");
  const int64_t b = qkv.size(0), t = qkv.size(1), heads = hq + 2 * hk;
  TORCH_CHECK(hq > 0 && hk > 0 && qkv.size(2) % heads == 0 && (qkv.size(2) / heads) % 2 == 0,
              "qkv's last dimension must be (Hq + 2 Hk) D with D even");
  const int64_t d = qkv.size(2) / heads;
  // cos and sin: [T, D] for every row, or [B, 1, T, D] per row (Decoder.rope's two layouts)
  const bool per_row = cos.dim() == 4;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                  (per_row ? cos.sizes() == at::IntArrayRef({b, 1, t, d}) : cos.sizes() == at::IntArrayRef({t, d})),
              "cos, sin: float32 [T, D] or [B, 1, T, D] tensors");
  at::Tensor out = at::empty({b, t, hq + hk, d}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* pc = cos.data_ptr<float>();
  const float* psn = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < t; ++j) {
      const int64_t table = ((per_row ? i * t : 0) + j) * d;
      for (int64_t h = 0; h < hq + hk; ++h)
        rope_head(in + ((i * t + j) * heads + h) * d, pc + table, psn + table, d,
                  o + ((i * t + j) * (hq + hk) + h) * d);
    }
  return out;
}

bool gemv_usable() { return LOWBIT_HAS_AVX512BF16; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_gemv", &bf16_gemv, "float32 [M, N] = a @ weight.T, weight bf16 [N, K], 1-4 rows rounded to bf16",
        py::arg("weight"), py::arg("a"));
  m.def("gemv_usable", &gemv_usable, "whether bf16_gemv runs in this build (the avx512bf16 level and above)");
  m.def("level", &build_level, "the instruction-set level this build was compiled for");
  m.def("add_rms_norm", &add_rms_norm, "(norm(x + residual) * weight, x + residual), float32", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [..., 2W] (gate first)", py::arg("gate_up"));
  m.def("rope_qk", &rope_qk, "RoPE of q and k of a joined projection: [B, T, Hq + Hk, D]", py::arg("qkv"),
        py::arg("cos"), py::arg("sin"), py::arg("hq"), py::arg("hk"));
}
