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

// The instruction-set level this translation unit is compiled for (runtime/native/__init__.py's
// LEVELS, one build per level, each with that level's flags): what its #if LOWBIT_HAS_* sections
// may use. Every kernel compiles at every level, the faster sections guarded by these.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOWBIT_HAS_AVX2 1
#else
#define LOWBIT_HAS_AVX2 0
#endif
#if LOWBIT_HAS_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define LOWBIT_HAS_AVX512 1
#else
#define LOWBIT_HAS_AVX512 0
#endif
// AVX512-BF16 with VBMI's byte permutes (the int4 kernel's nibble shuffle): Zen 4, Sapphire Rapids;
// Cooper Lake (BF16 without VBMI) runs the avx512 level
#if LOWBIT_HAS_AVX512 && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define LOWBIT_HAS_AVX512BF16 1
#else
#define LOWBIT_HAS_AVX512BF16 0
#endif
#if LOWBIT_HAS_AVX512BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LOWBIT_HAS_AMX 1
#else
#define LOWBIT_HAS_AMX 0
#endif

// Levels, lowest first, in runtime/native/__init__.py's LEVELS order
enum Level : int { kLevelPortable = 0, kLevelAvx2 = 1, kLevelAvx512 = 2, kLevelAvx512Bf16 = 3, kLevelAmx = 4 };
constexpr int kBuildLevel = LOWBIT_HAS_AMX ? kLevelAmx : LOWBIT_HAS_AVX512BF16 ? kLevelAvx512Bf16
                            : LOWBIT_HAS_AVX512 ? kLevelAvx512 : LOWBIT_HAS_AVX2 ? kLevelAvx2 : kLevelPortable;
inline const char* build_level() {
  constexpr const char* kNames[] = {"portable", "avx2", "avx512", "avx512bf16", "amx"};
  return kNames[kBuildLevel];
}

#ifdef LOWBIT_X86
// LDTILECFG's 64-byte operand
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The kernel's permission to use AMX's tile state (Linux: without it the first tile instruction
// faults), asked once per process; the CPU's AMX itself is cpu_level's check.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// The highest level this CPU and OS run: the instructions in CPUID, and the register state each needs
// saved by the OS in XCR0 (XGETBV; a hypervisor or kernel may leave AVX-512's or AMX's off while
// CPUID reports them), and for AMX the kernel's permission.
inline int cpu_level() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return kLevelPortable;
  const bool fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
  if (!(osxsave && avx && fma && f16c)) return kLevelPortable;
  unsigned xcr0_low, xcr0_high;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));  // _xgetbv needs -mxsave
  const auto saved = [&](unsigned mask) { return (xcr0_low & mask) == mask; };
  if (!saved(0x6) || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return kLevelPortable;  // SSE, AVX state
  const unsigned leaf7_ecx = c, leaf7_edx = d;
  if (!((b >> 5) & 1)) return kLevelPortable;  // AVX2
  const bool avx512 = ((b >> 16) & 1) && ((b >> 17) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1);  // F DQ BW VL
  if (!avx512 || !saved(0xE0)) return kLevelAvx2;  // opmask, ZMM upper halves, ZMM16-31
  unsigned bf16 = 0;
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) bf16 = (a >> 5) & 1;
  const bool vbmi = (leaf7_ecx >> 1) & 1;
  if (!(bf16 && vbmi)) return kLevelAvx512;
  const bool amx = ((leaf7_edx >> 22) & 1) && ((leaf7_edx >> 24) & 1) && ((leaf7_edx >> 25) & 1);  // BF16 TILE INT8
  if (!amx || !saved(0x60000) || !amx_permitted()) return kLevelAvx512Bf16;  // XTILECFG, XTILEDATA
  return kLevelAmx;
}
#else
inline bool amx_permitted() { return false; }
inline int cpu_level() { return kLevelPortable; }
#endif

// The paths a matmul kernel may run, slowest first (runtime/native/__init__.py's MATMUL_PATHS):
// kAvx512 is AVX512-BF16 dot products, kAvx2 runs at the avx2 and avx512 levels.
enum Path : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// The fastest path this build has and this process may run (a build never loads on a CPU below
// its level: runtime/native/__init__.py's check), which runs any slower one it is asked for.
inline int64_t best_path() {
  if (LOWBIT_HAS_AMX && amx_permitted()) return kAmx;
  if (LOWBIT_HAS_AVX512BF16) return kAvx512;
  return LOWBIT_HAS_AVX2 ? kAvx2 : kPortable;
}

}  // namespace
