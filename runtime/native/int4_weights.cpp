// Dequantizing a CPU int4 layer (runtime/cpu_linear.py's Int4Slots) into a caller's bf16 buffer, for
// a prefill's one dense bf16 matmul: one pass over the packed nibbles
// (the PyTorch path's chain of tensor ops made several, 8 ns per weight).
//
// Input: `packed`, uint8 [N, K/2] as _convert_weight_to_int4pack_for_cpu lays it out (outputs in
// blocks of `block_n`, each block stored [K, block_n/2] bytes, the last block possibly partial);
// byte j of a full block holds outputs j (low nibble) and j + block_n/2 (high) when `halves`, else
// 2j and 2j+1 (as a partial block always does). `scale_zeros`, bf16 [K/group, N, 2].
// Output: `out`, bf16 or float32 [K, N] (the weight's transpose): w = u * s + (z - 8 s), computed in
// float32 (exact for u * s, 4 by 8 significant bits, so fused multiply-add or not gives the same
// value); bf16 rounds it once, to nearest even: equal bit for bit to the PyTorch path
// (Int4Slots.dequantized). float32 keeps it unrounded, for a float32 prefill matmul on CPUs without a
// fast bf16 GEMM (a bf16 F.linear there ran 3-6x slower than float32's).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: all of libtorch's headers, a minute to build
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kChunkOutputs = 1024;  // 8 KB of float scales and offsets: L1

// One row's nibbles of one block of `size` outputs (bytes: the block's row, size / 2 of them), in
// output order. SIZE > 0: a full block of the layouts torch uses, whose loops then vectorize whole.
template <int64_t SIZE, bool HALVES>
inline void unpack_block(const uint8_t* __restrict bytes, int64_t size, uint8_t* __restrict u) {
  if (SIZE) size = SIZE;
  const int64_t half = size / 2;
  if (HALVES) {
    for (int64_t j = 0; j < half; ++j) u[j] = bytes[j] & 15;
    for (int64_t j = 0; j < half; ++j) u[half + j] = bytes[j] >> 4;
  } else {
    for (int64_t j = 0; j < half; ++j) {
      u[2 * j] = bytes[j] & 15;
      u[2 * j + 1] = bytes[j] >> 4;
    }
  }
}

// The nibbles of input `row` (of k) for outputs [first, last) (whole blocks), in output order, at
// nibbles[first].
void unpack_row(const uint8_t* packed, int64_t n, int64_t k, int64_t row, int64_t block_n, bool halves,
                int64_t first, int64_t last, uint8_t* nibbles) {
  const int64_t full = n / block_n * block_n;
  for (int64_t start = first; start < last; start += block_n) {
    const int64_t size = start < full ? block_n : n - full;
    const uint8_t* bytes = packed + start * k / 2 + row * (size / 2);  // block [K, size / 2]
    const bool whole_halves = size == block_n && halves;  // a partial block is always in pairs
    if (whole_halves && size == 64) {
      unpack_block<64, true>(bytes, size, nibbles + start);
    } else if (whole_halves && size == 32) {
      unpack_block<32, true>(bytes, size, nibbles + start);
    } else if (whole_halves) {
      unpack_block<0, true>(bytes, size, nibbles + start);
    } else {
      unpack_block<0, false>(bytes, size, nibbles + start);
    }
  }
}

// One group's scales and zero offsets (z - 8 s) as float32 [N] each.
void group_scales(const uint16_t* scale_zeros, int64_t n, int64_t g, float* __restrict scale,
                  float* __restrict offset) {
  const uint16_t* __restrict sz = scale_zeros + g * n * 2;
  for (int64_t j = 0; j < n; ++j) {
    const float s = bf16_to_float(sz[2 * j]);
    scale[j] = s;
    offset[j] = bf16_to_float(sz[2 * j + 1]) - 8.0f * s;
  }
}

inline void store(float w, uint16_t& out) { out = float_to_bf16_finite(w); }
inline void store(float w, float& out) { out = w; }

// OUT: uint16_t (bf16 bits) or float
template <class OUT>
void dequantize_row(const uint8_t* __restrict u, const float* __restrict scale, const float* __restrict offset,
                    int64_t n, OUT* __restrict out) {
  for (int64_t j = 0; j < n; ++j) store(static_cast<float>(u[j]) * scale[j] + offset[j], out[j]);
}

// The weight into `o` [K, N] (OUT: uint16_t, bf16 bits, or float).
template <class OUT>
void dequantize_into(const uint8_t* p, const uint16_t* sz, int64_t n, int64_t k, int64_t group, int64_t block_n,
                     bool halves, OUT* o) {
  // Rows in ranges of whole groups where possible, so a thread converts each group's scales once;
  // within a group, outputs in chunks whose float scales stay in L1 across the group's rows (all N
  // of them per row streamed 8 bytes of scales per weight from L2).
  const int64_t chunk = std::max<int64_t>(block_n, kChunkOutputs / block_n * block_n);
  at::parallel_for(0, k, group, [&](int64_t k0, int64_t k1) {
    std::vector<uint8_t> nibbles(n);
    std::vector<float> scale(n), offset(n);
    for (int64_t g0 = k0; g0 < k1; g0 = std::min(k1, (g0 / group + 1) * group)) {
      const int64_t g1 = std::min(k1, (g0 / group + 1) * group);
      group_scales(sz, n, g0 / group, scale.data(), offset.data());
      for (int64_t first = 0; first < n; first += chunk) {
        const int64_t last = std::min(n, first + chunk);
        for (int64_t row = g0; row < g1; ++row) {
          unpack_row(p, n, k, row, block_n, halves, first, last, nibbles.data());
          dequantize_row(nibbles.data() + first, scale.data() + first, offset.data() + first, last - first,
                         o + row * n + first);
        }
      }
    }
  });
}

void dequantize_int4(const at::Tensor& packed, const at::Tensor& scale_zeros, int64_t group,
                     int64_t block_n, bool halves, at::Tensor& out) {
  TORCH_CHECK(packed.dtype() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed: a contiguous uint8 [N, K/2] tensor");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(block_n > 0 && block_n % 2 == 0 && n % 2 == 0, "block_n and N must be even");
  TORCH_CHECK(group > 0 && k % group == 0, "group must divide K = ", k);
  TORCH_CHECK(scale_zeros.dtype() == at::kBFloat16 && scale_zeros.is_contiguous() &&
                  scale_zeros.sizes() == at::IntArrayRef({k / group, n, 2}),
              "scale_zeros: a contiguous bf16 [K/group, N, 2] tensor");
  TORCH_CHECK((out.dtype() == at::kBFloat16 || out.dtype() == at::kFloat) && out.is_contiguous() &&
                  out.sizes() == at::IntArrayRef({k, n}),
              "out: a contiguous bf16 [K, N] or float32 [K, N] tensor");
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const auto* sz = reinterpret_cast<const uint16_t*>(scale_zeros.data_ptr());
  if (out.dtype() == at::kFloat) {
    dequantize_into(p, sz, n, k, group, block_n, halves, out.data_ptr<float>());
  } else {
    dequantize_into(p, sz, n, k, group, block_n, halves, reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize_int4", &dequantize_int4, "Int4Slots' weight into a bf16 or float32 [K, N] buffer (out's dtype)",
        py::arg("packed"), py::arg("scale_zeros"), py::arg("group"), py::arg("block_n"), py::arg("halves"),
        py::arg("out"));
  m.def("level", &build_level, "the instruction-set level this build was compiled for");
}
