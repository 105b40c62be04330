#pragma once
// x86 vector code chosen at run time: the SSE2 forms of kvc's dequantization loops run on every
// x86-64 machine; their AVX2 forms are compiled for AVX2 alone (a function attribute, whatever the
// build's -march) and run where the CPU has it. avx2_enabled() is the switch: true when the CPU
// has AVX2; tests turn it off to run the SSE2 forms too. Not in CUDA translation units.

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define KVC_X86_AVX2_DISPATCH 1
#include <immintrin.h>
#define KVC_TARGET_AVX2 __attribute__((target("avx2")))
#endif

namespace kvc::detail {

// Whether the AVX2 forms run (see above).
inline bool& avx2_enabled() noexcept {
#if defined(KVC_X86_AVX2_DISPATCH)
  static bool enabled = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") != 0);
#else
  static bool enabled = false;
#endif
  return enabled;
}

}  // namespace kvc::detail
