// Decode attention over the paged KV cache's stored codes, on CPU: runtime/cpu_attention.py's algebra
// (scales and zero points folded; read its docstring) in one pass per (KV head x sequence) row,
// reading packed codes, scales and zero points from the pool through the block table (no gather copy,
// no float codes of the history written: a token's codes are widened in registers and used there).
//
// Per row: scores of every query head of the group over positions first..n (keys: pool blocks, then
// the float residual), softmax (scale folded into the query; optional soft-capping; positions before
// the window or past the length masked), then p.v (values: pool, then residual). Keys are scored 16
// tokens at a time: each token's partial products stay 16 lanes wide and one transposing tree of adds
// turns 16 of them into 16 scores (no horizontal sum per token).
//
// Layout (runtime/cache.py, kvquant/schemes/integer.py): pool tensors [N, H, ...] per page; data
// [N, H, B, D*bits/32] int32 (value i of a token in bits i*bits.. of its little-endian words, stored
// unsigned), or [N, H, B, D] float32 unquantized; keys per token: scale, zero [N, H, B, 1]; keys per
// channel over groups of G tokens (KIVI): [N, H, B/G, D]; values per token over channel groups:
// [N, H, B, groups]; float16 each. x = (u - z') * s with z' = zero + 2**(bits-1).
// Codes are widened 16 bytes at a time and each field f of a byte (bits f*b..) taken with one shift
// and mask: a row's values come out in field order (entry f*D/F + j is channel j*F + f, F = 8/bits),
// so queries are permuted into that order and outputs back.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: all of libtorch's headers, a minute to build
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "vec16.h"  // V, the 16-float vector (L floats; a score tile is L tokens)

namespace {

constexpr int MAX_CHUNKS = 16;  // head_dim <= 256
constexpr int MAX_BLOCK = 4096;  // block size x value channel groups

// One side (keys or values) of one layer's pool. bits 32: float32 floats as stored.
struct Side {
  const uint8_t* data;
  const at::Half* scale;
  const at::Half* zero;
  int bits, G;      // G: tokens per key group (over tokens), 0: per token
  int groups;       // values: channel groups per token (1: the whole head)
  int64_t row;      // bytes per token
  float offset;     // 2**(bits-1): z' = zero + offset
  int16_t order[MAX_CHUNKS * L];  // channel c's entry in field order
};

struct Problem {
  const float* q;          // [S, H, nq, D], the softmax scale folded in
  const int32_t* table;    // [S, M]
  const int64_t* lengths;  // [S]
  const int64_t* firsts;   // [S]
  const float* res_k;      // [S, H, B, D]
  const float* res_v;
  Side k, v;
  int64_t S, H, nq, D, B, M;
  float softcap;  // 0: none
  float* out;     // [S, H, nq, D]
};

// the float codes (or floats) of one token, D values (in field order for codes) as D/16 vectors
template <int BITS>
inline void token(const uint8_t* p, int D, V* u) {
  if constexpr (BITS == 32) {
    for (int c = 0; c < D / L; ++c) u[c] = V::load((const float*)p + c * L);
  } else {
    const int J = D * BITS / 8 / L;  // 16-byte chunks per token
    for (int j = 0; j < J; ++j) widen<BITS>(p + j * L, u + j, J);
  }
}

// Channel c's entry in field order for bits (identity for 8 and 32).
inline int field_index(int c, int bits, int D) {
  if (bits >= 8) return c;
  const int F = 8 / bits;
  return (c % F) * (D / F) + c / F;
}

// Scores [nq][16] of 16 consecutive tokens (rows at p, stride row bytes) for queries qv [nq][D/16]:
// raw sums q.u per token, then per-token keys' scale and zero, or the group's bias (over tokens).
template <int BITS>
void tile_scores(const Problem& P, const uint8_t* p, int64_t row, const V* qv, const float* bias,
                 const at::Half* scale, const at::Half* zero, const float* qsum, float* out, int64_t stride) {
  const int C = P.D / L;
  V parts[8 * L];  // [nq][16] partial vectors (nq <= 8 per call)
  for (int64_t h0 = 0; h0 < P.nq; h0 += 8) {
    const int nh = std::min<int64_t>(8, P.nq - h0);
    for (int t = 0; t < L; ++t) {
      V u[MAX_CHUNKS];
      token<BITS>(p + t * row, P.D, u);
      for (int h = 0; h < nh; ++h) {
        const V* qh = qv + (h0 + h) * C;
        V acc = mul(qh[0], u[0]);
        for (int c = 1; c < C; ++c) acc = fma(qh[c], u[c], acc);
        parts[h * L + t] = acc;
      }
    }
    for (int h = 0; h < nh; ++h) {
      V s = sums16(parts + h * L);
      if (scale != nullptr && P.k.G == 0) {  // per token: (sum - z' * sum q) * s
        V zt = fma(V::halves(zero), V::all(1.f), V::all(P.k.offset));
        s = mul(sub(s, mul(zt, V::all(qsum[h0 + h]))), V::halves(scale));
      } else if (bias != nullptr) {
        s = sub(s, V::all(bias[h0 + h]));
      }
      s.store(out + (h0 + h) * stride);
    }
  }
}

// Queries in field order (qv; the softmax scale folded in), or scaled by a key group's channel scales
// with that group's bias sum_c q_c s_c z'_c (over tokens): scale and zero permuted once per group.
void group_queries(const Problem& P, const float* q, const at::Half* scale, const at::Half* zero, V* qv,
                   float* bias) {
  const int C = P.D / L;
  alignas(64) float buf[MAX_CHUNKS * L], sf[MAX_CHUNKS * L], zf[MAX_CHUNKS * L];
  if (scale != nullptr) {
    alignas(64) float sn[MAX_CHUNKS * L], zn[MAX_CHUNKS * L];
    widen_halves(scale, P.D, sn);
    widen_halves(zero, P.D, zn);
    for (int c = 0; c < P.D; ++c) {
      const int at = P.k.order[c];
      sf[at] = sn[c];
      zf[at] = sn[c] * (zn[c] + P.k.offset);
    }
  }
  for (int64_t h = 0; h < P.nq; ++h) {
    for (int c = 0; c < P.D; ++c) buf[P.k.order[c]] = q[h * P.D + c];
    V b = V::zero();
    for (int c = 0; c < C; ++c) {
      V x = V::load(buf + c * L);
      if (scale != nullptr) {
        b = fma(x, V::load(zf + c * L), b);
        x = mul(x, V::load(sf + c * L));
      }
      qv[h * C + c] = x;
    }
    if (bias != nullptr) bias[h] = lanes_sum(b);
  }
}

template <int KB>
void key_scores(const Problem& P, int64_t s, int64_t h, int64_t t0, int64_t n, float* sc, int64_t stride) {
  const int C = P.D / L;
  const float* q = P.q + (s * P.H + h) * P.nq * P.D;
  std::vector<V> qv(P.nq * C), fv(P.nq * C);
  std::vector<float> bias(P.nq), qsum(P.nq);
  group_queries(P, q, nullptr, nullptr, qv.data(), nullptr);
  if (P.k.bits != 32) {  // the residual's floats take the queries in channel order
    Problem natural = P;
    for (int c = 0; c < P.D; ++c) natural.k.order[c] = int16_t(c);
    group_queries(natural, q, nullptr, nullptr, fv.data(), nullptr);
  } else {
    fv = qv;
  }
  for (int64_t i = 0; i < P.nq; ++i) {
    float t = 0.f;
    for (int c = 0; c < P.D; ++c) t += q[i * P.D + c];
    qsum[i] = t;
  }
  const int64_t stored = n / P.B * P.B;
  int64_t group = -1;
  std::vector<V> qg(P.nq * C);
  for (int64_t t = t0; t < stored; t += L) {
    const int64_t page = std::max<int32_t>(P.table[s * P.M + t / P.B], 0), tb = t % P.B;
    const int64_t base = page * P.H + h;
    const uint8_t* rows = P.k.data + (base * P.B + tb) * P.k.row;
    if (P.k.G) {  // per channel over groups of G tokens: the group's scales into the queries
      if (t / P.k.G != group) {
        group = t / P.k.G;
        const int64_t at = (base * (P.B / P.k.G) + tb / P.k.G) * P.D;
        group_queries(P, q, P.k.scale + at, P.k.zero + at, qg.data(), bias.data());
      }
      tile_scores<KB>(P, rows, P.k.row, qg.data(), bias.data(), nullptr, nullptr, nullptr, sc + (t - t0), stride);
    } else {
      const bool quantized = P.k.scale != nullptr;
      tile_scores<KB>(P, rows, P.k.row, qv.data(), nullptr, quantized ? P.k.scale + base * P.B + tb : nullptr,
                      quantized ? P.k.zero + base * P.B + tb : nullptr, qsum.data(), sc + (t - t0), stride);
    }
  }
  const float* res = P.res_k + (s * P.H + h) * P.B * P.D;  // the newest n - stored positions, float
  for (int64_t t = std::max(t0, stored); t < n; t += L)
    tile_scores<32>(P, (const uint8_t*)(res + (t - stored) * P.D), P.D * 4, fv.data(), nullptr, nullptr, nullptr,
                    nullptr, sc + (t - t0), stride);
}

// Softmax over sc[h][0..T) in place (positions before `first - t0` and from `n - t0` on masked):
// returns each query head's sum of weights (unnormalized exp).
void softmax(const Problem& P, float* sc, int64_t stride, int64_t lo, int64_t hi, float* total) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < P.nq; ++h) {
    float* x = sc + h * stride;
    for (int64_t t = 0; t < lo; ++t) x[t] = -inf;
    for (int64_t t = hi; t < stride; ++t) x[t] = -inf;
    if (P.softcap > 0)
      for (int64_t t = lo; t < hi; ++t) x[t] = std::tanh(x[t] / P.softcap) * P.softcap;
    V most = V::all(-inf);
    for (int64_t t = 0; t < stride; t += L) most = vmax(most, V::load(x + t));
    const float top = lanes_max(most);
    V sum = V::zero();
    for (int64_t t = 0; t < stride; t += L) {
      V e = exp16(sub(V::load(x + t), V::all(top)));
      e.store(x + t);
      sum = fma(e, V::all(1.f), sum);
    }
    total[h] = lanes_sum(sum);
  }
}

// Chunk c (16 values, field order for codes) of one token's row at p.
template <int BITS>
inline V chunk(const uint8_t* p, int c, int D) {
  if constexpr (BITS == 32) {
    return V::load((const float*)p + c * L);
  } else {
    const int J = D * BITS / 8 / L;  // 16-byte chunks per token; chunk c is field c / J of chunk c % J
    V u[8 / BITS];
    widen<BITS>(p + (c % J) * L, u, 1);
    return u[c / J];
  }
}

// out[h * C + i] += sum_t w[h * stride + t] * chunk c + i of token t (rows at p + t * row), for NH query
// heads and NC chunks: their sums stay in registers over the tokens, each row read once.
template <int BITS, int NH, int NC>
void chunk_sums(const uint8_t* p, int64_t row, int c, int D, const float* w, int64_t stride, int64_t count, V* out) {
  V acc[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < NC; ++i) acc[h][i] = V::zero();
  for (int64_t t = 0; t < count; ++t) {
    V u[NC];
    for (int i = 0; i < NC; ++i) u[i] = chunk<BITS>(p + t * row, c + i, D);
    for (int h = 0; h < NH; ++h) {
      const V wt = V::all(w[h * stride + t]);
      for (int i = 0; i < NC; ++i) acc[h][i] = fma(wt, u[i], acc[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < NC; ++i) out[h * (D / L) + i] = fma(acc[h][i], V::all(1.f), out[h * (D / L) + i]);
}

// chunk_sums for nh <= 4 heads and chunks c .. c + nc (nc <= 4, the chunks of one weight row)
template <int BITS>
void chunk_sums(int nh, int nc, const uint8_t* p, int64_t row, int c, int D, const float* w, int64_t stride,
                int64_t count, V* out) {
  using Fn = void (*)(const uint8_t*, int64_t, int, int, const float*, int64_t, int64_t, V*);
#define LOWBIT_ROW(h) chunk_sums<BITS, h, 1>, chunk_sums<BITS, h, 2>, chunk_sums<BITS, h, 3>, chunk_sums<BITS, h, 4>
  static constexpr Fn fns[16] = {LOWBIT_ROW(1), LOWBIT_ROW(2), LOWBIT_ROW(3), LOWBIT_ROW(4)};
#undef LOWBIT_ROW
  fns[(nh - 1) * 4 + nc - 1](p, row, c, D, w, stride, count, out);
}

// acc [nq][D/16] += sum_t w[h][t] * value_t over `count` tokens (rows at p): for codes, w * s of each
// channel group folded into the weights (ws [groups][nq][count]) and w * s * z' summed into zsum.
template <int VB>
void value_sums(const Problem& P, const uint8_t* p, int64_t row, const at::Half* scale, const at::Half* zero,
                const float* w, int64_t stride, int64_t count, V* acc, float* zsum, float* ws) {
  const int C = P.D / L, groups = P.v.groups;
  const int J = VB == 32 ? C : C * VB / 8;  // byte chunks per token: chunk c reads byte chunk c % J
  if (scale != nullptr) {
    alignas(64) float sf[MAX_BLOCK], zf[MAX_BLOCK];  // [groups][count]
    widen_halves(scale, count * groups, sf);
    widen_halves(zero, count * groups, zf);
    for (int g = 0; g < groups; ++g)
      for (int64_t h = 0; h < P.nq; ++h) {
        float* wg = ws + (g * P.nq + h) * count;
        int64_t t = 0;
        V zv = V::zero();
        for (; groups == 1 && t + L <= count; t += L) {  // one group: scales contiguous
          const V wt = mul(V::load(w + h * stride + t), V::load(sf + t));
          wt.store(wg + t);
          zv = fma(wt, fma(V::load(zf + t), V::all(1.f), V::all(P.v.offset)), zv);
        }
        float z = lanes_sum(zv);
        for (; t < count; ++t) {
          wg[t] = w[h * stride + t] * sf[t * groups + g];
          z += wg[t] * (zf[t * groups + g] + P.v.offset);
        }
        zsum[h * groups + g] += z;
      }
  }
  // chunks c.. of one channel group (the same weights), at most 4 at a time
  const int run = std::min(4, groups == 1 ? C : J / groups);
  for (int c = 0; c < C; c += run) {
    const float* wc = scale == nullptr ? w : ws + (c % J) / (J / groups) * P.nq * count;
    const int64_t wstride = scale == nullptr ? stride : count;
    for (int64_t h0 = 0; h0 < P.nq; h0 += 4)
      chunk_sums<VB>(int(std::min<int64_t>(4, P.nq - h0)), std::min(run, C - c), p, row, c, P.D, wc + h0 * wstride,
                     wstride, count, acc + h0 * C + c);
  }
}

template <int VB>
void values(const Problem& P, int64_t s, int64_t h, int64_t t0, int64_t first, int64_t n, const float* sc,
            int64_t stride, const float* total) {
  const int C = P.D / L;
  std::vector<V> acc(P.nq * C, V::zero()), facc(P.nq * C, V::zero());
  std::vector<float> zsum(P.nq * P.v.groups, 0.f), ws(P.v.groups * P.nq * P.B);
  const int64_t stored = n / P.B * P.B;
  for (int64_t t = first; t < stored;) {  // block by block
    const int64_t page = std::max<int32_t>(P.table[s * P.M + t / P.B], 0), tb = t % P.B;
    const int64_t count = std::min(stored, (t / P.B + 1) * P.B) - t, base = page * P.H + h;
    const bool quantized = P.v.scale != nullptr;
    value_sums<VB>(P, P.v.data + (base * P.B + tb) * P.v.row, P.v.row,
                   quantized ? P.v.scale + (base * P.B + tb) * P.v.groups : nullptr,
                   quantized ? P.v.zero + (base * P.B + tb) * P.v.groups : nullptr, sc + (t - t0), stride, count,
                   acc.data(), zsum.data(), ws.data());
    t += count;
  }
  const int64_t from = std::max(first, stored);
  if (from < n)
    value_sums<32>(P, (const uint8_t*)(P.res_v + ((s * P.H + h) * P.B + from - stored) * P.D), P.D * 4, nullptr,
                   nullptr, sc + (from - t0), stride, n - from, facc.data(), nullptr, nullptr);
  // back to channel order; minus the zero points' sums; divided by the softmax's total
  alignas(64) float buf[MAX_CHUNKS * L], fbuf[MAX_CHUNKS * L];
  const int J = P.v.bits >= 8 ? C : C * P.v.bits / 8;
  for (int64_t i = 0; i < P.nq; ++i) {
    for (int c = 0; c < C; ++c) {
      acc[i * C + c].store(buf + c * L);
      facc[i * C + c].store(fbuf + c * L);
    }
    float* o = P.out + ((s * P.H + h) * P.nq + i) * P.D;
    for (int c = 0; c < P.D; ++c) {
      const int at = P.v.order[c];
      float x = buf[at];
      if (P.v.scale != nullptr) x -= zsum[i * P.v.groups + (at / L % J) / (J / P.v.groups)];
      o[c] = (x + fbuf[c]) / total[i];
    }
  }
}

template <int KB, int VB>
void attend_row(const Problem& P, int64_t r) {
  const int64_t s = r % P.S, h = r / P.S, n = P.lengths[s], first = P.firsts[s];
  float* o = P.out + (s * P.H + h) * P.nq * P.D;
  if (n <= first) {
    std::fill(o, o + P.nq * P.D, 0.f);
    return;
  }
  const int64_t t0 = first / L * L, stride = (n - t0 + L - 1) / L * L;
  std::vector<float> sc(P.nq * stride), total(P.nq);
  key_scores<KB>(P, s, h, t0, n, sc.data(), stride);
  softmax(P, sc.data(), stride, first - t0, n - t0, total.data());
  values<VB>(P, s, h, t0, first, n, sc.data(), stride, total.data());
}

// Rows per thread: the rows of a call split over the threads from kParallelPairs (query head x key
// token) pairs, in chunks of about that many. Waking the pool's sleeping thread (a futex under
// OMP_WAIT_POLICY=PASSIVE) costs tens of us; a row over a short context a few: decode over 32 tokens at
// batch 8 (2,304 pairs, SmolLM2's 3 x 3 heads) took 62 us on one thread, 81 on two; from ~4,600 pairs two
// threads were ahead (bench/results/cpu/NOTES.md).
constexpr int64_t kParallelPairs = 4096;

int64_t rows_per_thread(const Problem& P) {
  int64_t tokens = 0;
  for (int64_t s = 0; s < P.S; ++s) tokens += std::max<int64_t>(P.lengths[s] - P.firsts[s], 0);
  const int64_t rows = P.S * P.H, pairs = std::max<int64_t>(tokens * P.H * P.nq, 1);
  return std::max<int64_t>(1, rows * kParallelPairs / pairs);
}

template <int KB, int VB>
void attend(const Problem& P) {
  at::parallel_for(0, P.S * P.H, rows_per_thread(P), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) attend_row<KB, VB>(P, r);
  });
}

using Attend = void (*)(const Problem&);
template <int KB>
Attend pick(int vb) {
  switch (vb) {
    case 32: return attend<KB, 32>;
    case 8: return attend<KB, 8>;
    case 4: return attend<KB, 4>;
    case 2: return attend<KB, 2>;
  }
  TORCH_CHECK(false, "value bits must be 32, 8, 4 or 2, got ", vb);
}

Side side(const at::Tensor& data, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& zero,
          int64_t bits, int64_t G, int64_t H, int64_t B, int64_t D) {
  TORCH_CHECK(data.is_contiguous() && scale.has_value() == (bits != 32), "pool data must be contiguous, scales iff codes");
  TORCH_CHECK(bits == 32 ? data.scalar_type() == at::kFloat : data.scalar_type() == at::kInt, "pool data dtype");
  TORCH_CHECK(data.dim() == 4 && data.size(1) == H && data.size(2) == B && data.size(3) == (bits == 32 ? D : D * bits / 32),
              "pool data must be [N, H, B, D or D*bits/32]");
  Side out{(const uint8_t*)data.data_ptr(), nullptr, nullptr, (int)bits, (int)G, 1, bits == 32 ? D * 4 : D * bits / 8,
           bits == 32 ? 0.f : float(1 << (bits - 1))};
  for (int c = 0; c < D; ++c) out.order[c] = int16_t(field_index(c, int(bits), int(D)));
  if (scale) {
    TORCH_CHECK(scale->scalar_type() == at::kHalf && zero->scalar_type() == at::kHalf && scale->is_contiguous() &&
                zero->is_contiguous(), "scales and zero points must be contiguous float16");
    out.scale = (const at::Half*)scale->data_ptr();
    out.zero = (const at::Half*)zero->data_ptr();
    out.groups = G ? 1 : (int)scale->size(-1);
    const int64_t per_page = G ? B / G * D : B * out.groups;  // scales (and zeros) per page and head
    TORCH_CHECK(scale->sizes() == zero->sizes() && scale->size(0) == data.size(0) &&
                scale->numel() == data.size(0) * H * per_page, "scales must match the pool's layout");
  }
  return out;
}

}  // namespace

// q [S, H, nq, D] float32 (the softmax scale applied), block_table [S, M] int32, lengths and firsts [S]
// int64 (positions held, the new one included; first position read), pools as stored (bits 32: float32
// floats), residuals [S, H, B, D] float32; softcap 0: none. Returns [S, H, nq, D] float32.
at::Tensor decode_attention(at::Tensor q, at::Tensor block_table, at::Tensor lengths, at::Tensor firsts,
                               at::Tensor k_data, c10::optional<at::Tensor> k_scale,
                               c10::optional<at::Tensor> k_zero, int64_t k_bits, int64_t k_group,
                               at::Tensor v_data, c10::optional<at::Tensor> v_scale,
                               c10::optional<at::Tensor> v_zero, int64_t v_bits, at::Tensor residual_k,
                               at::Tensor residual_v, double softcap) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be [S, H, nq, D] float32");
  const int64_t S = q.size(0), H = q.size(1), nq = q.size(2), D = q.size(3), B = residual_k.size(2);
  TORCH_CHECK(D % L == 0 && D <= L * MAX_CHUNKS && B % L == 0, "head_dim and block size must be multiples of 16");
  TORCH_CHECK(residual_k.scalar_type() == at::kFloat && residual_k.is_contiguous() && residual_v.is_contiguous() &&
              residual_v.scalar_type() == at::kFloat, "residuals must be contiguous float32");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.size(0) == S,
              "block table must be [S, M] int32");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && firsts.scalar_type() == at::kLong && lengths.numel() == S &&
              firsts.numel() == S, "lengths and firsts must be [S] int64");
  TORCH_CHECK(residual_k.sizes() == residual_v.sizes() && residual_k.size(0) == S && residual_k.size(1) == H &&
              residual_k.size(3) == D, "residuals must be [S, H, B, D]");
  const int64_t M = block_table.size(1), pages = k_data.size(0);
  for (int64_t s = 0; s < S; ++s) {  // every position read lies within the block table's reach, on a page
    const int64_t n = lengths.data_ptr<int64_t>()[s];
    TORCH_CHECK(n >= 1 && n <= M * B, "lengths must lie in 1..", M * B, " (the block table's reach), got ", n);
    for (int64_t b = 0; b < n / B; ++b)
      TORCH_CHECK(block_table.data_ptr<int32_t>()[s * M + b] < pages, "a block table entry past the pool's pages");
  }
  TORCH_CHECK(!k_group || (k_group % L == 0 && B % k_group == 0), "key groups must be multiples of 16 dividing B");
  auto out = at::empty_like(q);
  Problem P{q.data_ptr<float>(), block_table.data_ptr<int32_t>(), lengths.data_ptr<int64_t>(),
            firsts.data_ptr<int64_t>(), residual_k.data_ptr<float>(), residual_v.data_ptr<float>(),
            side(k_data, k_scale, k_zero, k_bits, k_group, H, B, D), side(v_data, v_scale, v_zero, v_bits, 0, H, B, D),
            S, H, nq, D, B, block_table.size(1), float(softcap), out.data_ptr<float>()};
  const int J = v_bits == 32 ? 0 : int(D * v_bits / 8 / L);
  TORCH_CHECK(v_bits == 32 || (J >= 1 && J % P.v.groups == 0 && B * P.v.groups <= MAX_BLOCK),
              "value channel groups must cover whole 16-byte chunks (at most 4096 scales a block)");
  TORCH_CHECK(k_bits == 32 || D * k_bits / 8 % L == 0, "a token's key codes must be whole 16-byte chunks");
  Attend run;
  switch (k_bits) {
    case 32: run = pick<32>(v_bits); break;
    case 8: run = pick<8>(v_bits); break;
    case 4: run = pick<4>(v_bits); break;
    case 2: run = pick<2>(v_bits); break;
    default: TORCH_CHECK(false, "key bits must be 32, 8, 4 or 2, got ", k_bits);
  }
  run(P);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over the paged KV cache's stored codes");
  m.def("level", &build_level, "the instruction-set level this build was compiled for");
}
