// 16 floats as one vector for runtime/native/kv_attention.cpp: AVX512 where the build has it, two
// AVX2 registers at the avx2 level, plain loops the compiler vectorizes otherwise; the same operations either way (loads, FMA, lane sums and
// maxima, 16 codes of a byte field widened to floats, 16 lane sums as one vector, exp, float16 rows).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

constexpr int L = 16;  // floats per vector

#ifdef __AVX512F__
struct V {
  __m512 x;
  static V zero() { return {_mm512_setzero_ps()}; }
  static V all(float a) { return {_mm512_set1_ps(a)}; }
  static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V halves(const at::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
  void store(float* p) const { _mm512_storeu_ps(p, x); }
};
inline V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.x, b.x, c.x)}; }
inline V sub(V a, V b) { return {_mm512_sub_ps(a.x, b.x)}; }
inline V mul(V a, V b) { return {_mm512_mul_ps(a.x, b.x)}; }
inline V vmax(V a, V b) { return {_mm512_max_ps(a.x, b.x)}; }
inline float lanes_sum(V a) { return _mm512_reduce_add_ps(a.x); }
inline float lanes_max(V a) { return _mm512_reduce_max_ps(a.x); }

// field f of 16 bytes at p, as 16 floats (unsigned codes, exact)
template <int BITS>
inline void widen(const uint8_t* p, V* out, int stride) {
  __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  if constexpr (BITS == 8) {
    out[0] = {_mm512_cvtepi32_ps(w)};
  } else {
    const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
    for (int f = 0; f < 8 / BITS; ++f)
      out[f * stride] = {_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, f * BITS), mask))};
  }
}

// p[t] summed over its lanes, for 16 tokens t: one vector of 16 sums (a transposing tree of adds)
inline V sums16(const V* p) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i].x, p[2 * i + 1].x), _mm512_unpackhi_ps(p[2 * i].x, p[2 * i + 1].x));
  for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)))};
}

// exp of 16 floats <= 0 (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp); below
// -103 (and -inf: masked) gives 0
inline V exp16(V v) {
  __m512 x = _mm512_max_ps(v.x, _mm512_set1_ps(-103.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  __m512 e = _mm512_scalef_ps(p, n);
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(v.x, _mm512_set1_ps(-103.f), _CMP_LT_OQ), e, _mm512_setzero_ps())};
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// lanes 0-7 in lo, 8-15 in hi; the same operations as the AVX512 V lane by lane, and lanes_sum's
// tree is _mm512_reduce_add_ps's (halves, quarters, pairs), so both levels sum a vector alike
struct V {
  __m256 lo, hi;
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V all(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V halves(const at::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
};
inline V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
template <class OP>
inline float lanes_reduce(V a, OP op) {
  const __m256 quarter = op(a.hi, a.lo);
  const __m128 pair = op(_mm256_extractf128_ps(quarter, 1), _mm256_castps256_ps128(quarter));
  const __m128 two = op(pair, _mm_shuffle_ps(pair, pair, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(op(two, _mm_shuffle_ps(two, two, _MM_SHUFFLE(0, 0, 0, 1))));
}
struct Add {
  __m256 operator()(__m256 a, __m256 b) const { return _mm256_add_ps(a, b); }
  __m128 operator()(__m128 a, __m128 b) const { return _mm_add_ps(a, b); }
};
struct Max {
  __m256 operator()(__m256 a, __m256 b) const { return _mm256_max_ps(a, b); }
  __m128 operator()(__m128 a, __m128 b) const { return _mm_max_ps(a, b); }
};
inline float lanes_sum(V a) { return lanes_reduce(a, Add()); }
inline float lanes_max(V a) { return lanes_reduce(a, Max()); }

template <int BITS>
inline void widen(const uint8_t* p, V* out, int stride) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
  if constexpr (BITS == 8) {
    out[0] = {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
  } else {
    const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
    for (int f = 0; f < 8 / BITS; ++f)
      out[f * stride] = {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lo, f * BITS), mask)),
                         _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(hi, f * BITS), mask))};
  }
}

// 8 vectors of 8 summed across lanes: one vector of their 8 sums (horizontal adds, then the halves)
inline __m256 sums8(const __m256* s) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
inline V sums16(const V* p) {
  __m256 s[16];
  for (int t = 0; t < 16; ++t) s[t] = _mm256_add_ps(p[t].lo, p[t].hi);
  return {sums8(s), sums8(s + 8)};
}

// exp16's Cephes expf in 8 lanes; 2^n in two normal halves (n reaches -149 where scalef goes subnormal)
inline __m256 exp8(__m256 v) {
  __m256 x = _mm256_max_ps(v, _mm256_set1_ps(-103.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  const auto power = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  const __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, power(half)), power(_mm256_sub_epi32(ni, half)));
  return _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(v, _mm256_set1_ps(-103.f), _CMP_LT_OQ));
}
inline V exp16(V v) { return {exp8(v.lo), exp8(v.hi)}; }
#else  // plain loops (the compiler vectorizes them for what this CPU has)
struct V {
  float x[L];
  static V zero() { return all(0.f); }
  static V all(float a) { V v; for (int i = 0; i < L; ++i) v.x[i] = a; return v; }
  static V load(const float* p) { V v; for (int i = 0; i < L; ++i) v.x[i] = p[i]; return v; }
  static V halves(const at::Half* p) { V v; for (int i = 0; i < L; ++i) v.x[i] = float(p[i]); return v; }
  void store(float* p) const { for (int i = 0; i < L; ++i) p[i] = x[i]; }
};
inline V fma(V a, V b, V c) { for (int i = 0; i < L; ++i) c.x[i] = std::fma(a.x[i], b.x[i], c.x[i]); return c; }
inline V sub(V a, V b) { for (int i = 0; i < L; ++i) a.x[i] -= b.x[i]; return a; }
inline V mul(V a, V b) { for (int i = 0; i < L; ++i) a.x[i] *= b.x[i]; return a; }
inline V vmax(V a, V b) { for (int i = 0; i < L; ++i) a.x[i] = std::max(a.x[i], b.x[i]); return a; }
inline float lanes_sum(V a) { float s = 0.f; for (float x : a.x) s += x; return s; }
inline float lanes_max(V a) { float s = a.x[0]; for (float x : a.x) s = std::max(s, x); return s; }
template <int BITS>
inline void widen(const uint8_t* p, V* out, int stride) {
  for (int f = 0; f < 8 / BITS; ++f)
    for (int i = 0; i < L; ++i) out[f * stride].x[i] = float((p[i] >> (f * BITS)) & ((1 << BITS) - 1));
}
inline V sums16(const V* p) {
  V out;
  for (int t = 0; t < L; ++t) { float s = 0.f; for (int i = 0; i < L; ++i) s += p[t].x[i]; out.x[t] = s; }
  return out;
}
inline V exp16(V v) { for (int i = 0; i < L; ++i) v.x[i] = std::exp(v.x[i]); return v; }
#endif

// n float16 values at p as floats at out (vectors of 16, then one by one)
inline void widen_halves(const at::Half* p, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + L <= n; i += L) V::halves(p + i).store(out + i);
  for (; i < n; ++i) out[i] = float(p[i]);
}

}  // namespace
