#pragma once
// kvc::float8_e4m3 and kvc::float8_e5m2: the two 8-bit floating-point formats of the OCP 8-bit
// Floating Point Specification (OFP8, revision 1.0), as storage types for keys and values.
//
//   E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits. No infinities; S.1111.111 is NaN, so the
//         largest finite value is S.1111.110 = 448. Smallest normal 2^-6, smallest subnormal 2^-9.
//   E5M2: sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like: S.11111.00 is infinity,
//         S.11111.{01,10,11} NaN, largest finite S.11110.11 = 57344. Smallest normal 2^-14,
//         smallest subnormal 2^-16.
//
// Conversion from float rounds to nearest, ties to even (OFP8 section 5.2). What overflows after
// rounding (and an infinity) follows the spec's two modes: saturating (the default, what KV caches
// use) gives the largest finite value of the sign; non-saturating gives infinity (E5M2) or NaN
// (E4M3, which has no infinity). NaN converts to NaN (0x7F with the input's sign) in both. Every
// one of the 256 codes of each format decodes exactly to a float.

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>
#endif

#include <kvc/detail/host_device.hpp>
#include <kvc/detail/simd.hpp>

namespace kvc {

// What a float too large for the format converts to: the largest finite value of its sign
// (saturate), or infinity / NaN (non_saturating).
enum class fp8_overflow : std::uint8_t { saturate, non_saturating };

namespace detail {

// The parameters of one OFP8 format.
template <int ExponentBits, int MantissaBits, bool HasInfinity>
struct fp8_format {
  static constexpr int exponent_bits = ExponentBits;
  static constexpr int mantissa_bits = MantissaBits;
  static constexpr int bias = (1 << (ExponentBits - 1)) - 1;
  static constexpr bool has_infinity = HasInfinity;
  static constexpr std::uint8_t exponent_mask = ((1u << ExponentBits) - 1u) << MantissaBits;
  static constexpr std::uint8_t mantissa_mask = (1u << MantissaBits) - 1u;
  // The largest finite code of the positive sign: E5M2's exponent field below all ones, E4M3's all
  // ones with the mantissa below all ones (all ones there is NaN).
  static constexpr std::uint8_t max_finite =
      HasInfinity ? static_cast<std::uint8_t>(exponent_mask - (1u << MantissaBits) + mantissa_mask)
                  : static_cast<std::uint8_t>(exponent_mask | (mantissa_mask - 1u));
  static constexpr std::uint8_t nan = 0x7F;                // both formats: exponent and mantissa all ones
  static constexpr std::uint8_t infinity = exponent_mask;  // E5M2 only

  static constexpr bool is_nan(std::uint8_t code) noexcept {
    const std::uint8_t magnitude = code & 0x7F;
    if (has_infinity) return (magnitude & exponent_mask) == exponent_mask && (magnitude & mantissa_mask) != 0;
    return magnitude == 0x7F;
  }

  // The value of a code, in host and device code: the scalar reference of every fp8 -> float
  // conversion in kvc (widen's SIMD forms and the attention kernels' are tested against it bit for
  // bit). The code's exponent and mantissa bits placed in a float's, times 2^(127 - bias): exact,
  // subnormal codes included; NaN codes give the quiet NaN 0x7FC00000 and infinities 0x7F800000,
  // then the code's sign.
  KVC_HOST_DEVICE static float decode(std::uint8_t code) noexcept {
    const std::uint32_t magnitude = code & 0x7Fu;
    std::uint32_t u = 0;
    if (is_nan(code))
      u = 0x7FC00000u;
    else if (has_infinity && magnitude == infinity)
      u = 0x7F800000u;
    const float v = u != 0 ? bits_to_float(u)
                           : bits_to_float(magnitude << (23 - MantissaBits)) *
                                 bits_to_float(static_cast<std::uint32_t>(127 + 127 - bias) << 23);
    return (code & 0x80u) != 0 ? -v : v;
  }
  KVC_HOST_DEVICE static float bits_to_float(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
  }
  KVC_HOST_DEVICE static std::uint32_t float_to_bits(float f) noexcept {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
#endif
  }

  // The code of a float, rounded to nearest even, in host and device code.
  KVC_HOST_DEVICE static std::uint8_t encode(float x, fp8_overflow mode) noexcept {
    const std::uint32_t bits = float_to_bits(x);
    const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80);
    // Integer steps on the float's bits (no libm): |x| shifted to the code's last mantissa bit,
    // rounded to nearest even; a carry moves into the exponent by itself.
    const std::uint32_t a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return static_cast<std::uint8_t>(sign | nan);  // NaN
    const std::uint8_t overflow = mode == fp8_overflow::saturate
                                      ? static_cast<std::uint8_t>(sign | max_finite)
                                      : static_cast<std::uint8_t>(sign | (has_infinity ? infinity : nan));
    if (a == 0x7F800000u) return overflow;          // an infinity
    const int e = static_cast<int>(a >> 23) - 127;  // the float's exponent (-127: a float subnormal)
    std::uint32_t code = 0;
    if (e < 1 - bias) {
      // A subnormal code, or zero: units of 2^(1 - bias - M). Float subnormals, and every float
      // below half the smallest unit, round to zero.
      const int shift = 23 + (1 - bias - MantissaBits) - e;
      if (a < 0x00800000u || shift >= 25) return sign;
      code = round_shift((a & 0x007FFFFFu) | 0x00800000u, shift);
    } else {
      code = round_shift(a - (static_cast<std::uint32_t>(127 - bias) << 23), 23 - MantissaBits);
    }
    if (code > max_finite) return overflow;
    return static_cast<std::uint8_t>(sign | code);
  }

  // v >> shift (0 < shift < 32), rounded to nearest even.
  static constexpr std::uint32_t round_shift(std::uint32_t v, int shift) noexcept {
    const std::uint32_t r = v >> shift, rest = v & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return rest > half || (rest == half && (r & 1u) != 0) ? r + 1 : r;
  }
};

using e4m3_format = fp8_format<4, 3, false>;
using e5m2_format = fp8_format<5, 2, true>;

// One 8-bit float type per format: a code, converted to and from float.
template <class Format>
struct float8 {
  using format = Format;
  std::uint8_t bits = 0;

  constexpr float8() noexcept = default;
  // Rounds to nearest even and saturates (the OFP8 conversion in saturating mode).
  explicit float8(float x) noexcept : bits(Format::encode(x, fp8_overflow::saturate)) {}
  float8(float x, fp8_overflow mode) noexcept : bits(Format::encode(x, mode)) {}

  static constexpr float8 from_bits(std::uint8_t code) noexcept {
    float8 f;
    f.bits = code;
    return f;
  }
  explicit operator float() const noexcept { return Format::decode(bits); }
  explicit operator double() const noexcept { return Format::decode(bits); }
  // The values of all 256 codes, by code.
  static const float* values_table() noexcept {
    static const auto table = [] {
      std::array<float, 256> t{};
      for (int c = 0; c < 256; ++c) t[static_cast<std::size_t>(c)] = Format::decode(static_cast<std::uint8_t>(c));
      return t;
    }();
    return table.data();
  }

  // dst[i] = float(src[i]) for i < n, bit for bit as Format::decode: what attention widens stored
  // codes with. Eight at a time with AVX2 where the CPU has it (detail::avx2_enabled), then four at
  // a time with SSE2, decode's steps on vectors, then the values table for the rest.
  static void widen(const float8* src, float* dst, std::int64_t n) noexcept {
    std::int64_t i = 0;
#if defined(KVC_X86_AVX2_DISPATCH)
    if (avx2_enabled()) i = widen_avx2(src, dst, n);
#endif
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
    constexpr int shift = 23 - Format::mantissa_bits;  // mantissa's top bit to the float's
    const __m128 rebias = _mm_castsi128_ps(_mm_set1_epi32((127 + 127 - Format::bias) << 23));  // 2^(127 - bias)
    const __m128i zero = _mm_setzero_si128(), magnitude = _mm_set1_epi32(0x7F);
    const __m128i special = _mm_set1_epi32(Format::has_infinity ? Format::exponent_mask : 0x7F);
    for (; i + 4 <= n; i += 4) {
      std::int32_t word;
      std::memcpy(&word, src + i, 4);
      const __m128i b = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(word), zero), zero);
      const __m128i m = _mm_and_si128(b, magnitude);
      __m128 v = _mm_mul_ps(_mm_castsi128_ps(_mm_slli_epi32(m, shift)), rebias);
      // E4M3: 0x7F is NaN; E5M2: an all-ones exponent is infinity (mantissa 0) or NaN.
      const __m128i is_special =
          Format::has_infinity ? _mm_cmpeq_epi32(_mm_and_si128(m, special), special) : _mm_cmpeq_epi32(m, special);
      // Infinity (mantissa 0) is 0x7F800000, every NaN the quiet NaN 0x7FC00000, as decode gives.
      const __m128 inf_nan = _mm_castsi128_ps(
          Format::has_infinity
              ? _mm_or_si128(
                    _mm_set1_epi32(0x7F800000),
                    _mm_andnot_si128(_mm_cmpeq_epi32(_mm_and_si128(m, _mm_set1_epi32(Format::mantissa_mask)), zero),
                                     _mm_set1_epi32(0x00400000)))
              : _mm_set1_epi32(0x7FC00000));
      v = _mm_or_ps(_mm_and_ps(_mm_castsi128_ps(is_special), inf_nan), _mm_andnot_ps(_mm_castsi128_ps(is_special), v));
      const __m128i sign = _mm_slli_epi32(_mm_and_si128(b, _mm_set1_epi32(0x80)), 24);
      _mm_storeu_ps(dst + i, _mm_or_ps(v, _mm_castsi128_ps(sign)));
    }
#endif
    const float* table = values_table();
    for (; i < n; ++i) dst[i] = table[src[i].bits];
  }
#if defined(KVC_X86_AVX2_DISPATCH)
  // widen's AVX2 form (the same steps, eight at a time); returns how many it did.
  KVC_TARGET_AVX2 static std::int64_t widen_avx2(const float8* src, float* dst, std::int64_t n) noexcept {
    constexpr int shift = 23 - Format::mantissa_bits;
    const __m256 rebias = _mm256_castsi256_ps(_mm256_set1_epi32((127 + 127 - Format::bias) << 23));
    const __m256i magnitude = _mm256_set1_epi32(0x7F);
    const __m256i special = _mm256_set1_epi32(Format::has_infinity ? Format::exponent_mask : 0x7F);
    std::int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      const __m256i m = _mm256_and_si256(b, magnitude);
      const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(m, shift)), rebias);
      const __m256i is_special = Format::has_infinity ? _mm256_cmpeq_epi32(_mm256_and_si256(m, special), special)
                                                      : _mm256_cmpeq_epi32(m, special);
      const __m256 inf_nan = _mm256_castsi256_ps(
          Format::has_infinity
              ? _mm256_or_si256(_mm256_set1_epi32(0x7F800000),
                                _mm256_andnot_si256(
                                    _mm256_cmpeq_epi32(_mm256_and_si256(m, _mm256_set1_epi32(Format::mantissa_mask)),
                                                       _mm256_setzero_si256()),
                                    _mm256_set1_epi32(0x00400000)))
              : _mm256_set1_epi32(0x7FC00000));
      const __m256 r = _mm256_blendv_ps(v, inf_nan, _mm256_castsi256_ps(is_special));
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
      _mm256_storeu_ps(dst + i, _mm256_or_ps(r, _mm256_castsi256_ps(sign)));
    }
    return i;
  }
#endif
  float to_float() const noexcept { return Format::decode(bits); }
  bool is_nan() const noexcept { return Format::is_nan(bits); }

  // Bit equality (both zeros differ, as do NaN codes).
  friend constexpr bool operator==(float8 a, float8 b) noexcept { return a.bits == b.bits; }
};

}  // namespace detail

// The OFP8 E4M3 format: 4 exponent bits, 3 mantissa bits, largest finite 448, no infinity.
using float8_e4m3 = detail::float8<detail::e4m3_format>;
// The OFP8 E5M2 format: 5 exponent bits, 2 mantissa bits, largest finite 57344, with infinities.
using float8_e5m2 = detail::float8<detail::e5m2_format>;

// Whether T is one of kvc's fp8 code types (kvc::float8_e4m3, kvc::float8_e5m2).
template <class T>
inline constexpr bool is_float8_v = false;
template <class Format>
inline constexpr bool is_float8_v<detail::float8<Format>> = true;

}  // namespace kvc
