// What lowbit's CPU kernels share (runtime/native/*.cpp include it). runtime/native/__init__.py hashes
// every header here into the build folder's name: torch's JIT hashes only the .cpp files it is given,
// so a changed header would otherwise leave the old build in use.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LOWBIT_X86 1
#endif

namespace {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// c10's round_to_nearest_even (NaN kept a quiet NaN)
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
}

// The same for finite values, branch-free so the loops that call it vectorize (a NaN, only from a NaN
// or infinite input, stays a NaN but may keep its sign where c10 writes 0x7FC0)
inline uint16_t float_to_bf16_finite(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// The paths a matmul kernel may run, slowest first (runtime/cpu_int4_gemm.py and cpu_int8_gemm.py
// name them in this order)
enum Path : int64_t { kPortable = 0, kAvx512 = 1, kAmx = 2 };

#ifdef LOWBIT_X86
// LDTILECFG's 64-byte operand
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// AMX-TILE and AMX-BF16 in CPUID, and the kernel's permission to use the tile state (Linux).
inline bool amx_usable() {
  static const bool usable = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return tile && bf16 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// AVX512-BF16 with the extensions both matmul kernels' vector paths use (VL; VBMI's byte permutes)
inline bool cpu_has_avx512_bf16() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("avx512bf16");
}
#else
inline bool amx_usable() { return false; }
inline bool cpu_has_avx512_bf16() { return false; }
#endif

// The fastest matmul path this CPU and OS allow (the int4 kernel's for full blocks of 64 with
// `halves`; it runs the portable loop on others)
inline int64_t best_path() {
  if (!cpu_has_avx512_bf16()) return kPortable;
  return amx_usable() ? kAmx : kAvx512;
}

}  // namespace
