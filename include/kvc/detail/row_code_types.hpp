#pragma once
// The row-code element types of kvc's paged pools (kvc::int8_row, int4_row, int2_row, nvfp4_row and
// kvc::rotated<C>) and their codecs, with no tensor types: what kvc::PagedCache needs of them.
// Users include <kvc/row_codes.hpp>, which adds kvc::to_row_codes and kvc::from_row_codes and
// describes the formats.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string_view>
#include <type_traits>

#include <math.h>  // fmaxf, nearbyintf: one name in host and device code

#include <kvc/detail/host_device.hpp>
#include <kvc/detail/simd.hpp>
#include <kvc/detail/traits.hpp>
#include <kvc/errors.hpp>
#include <kvc/float8.hpp>
#include <kvc/nvfp4.hpp>

namespace kvc {

namespace detail {

// The codecs below encode and read rows in host and device code alike (KVC_HOST_DEVICE, so that
// CUDA kernels run the host's arithmetic), with the C names of the float functions (fmaxf,
// nearbyintf: one name on both sides) and the bits helpers of <kvc/nvfp4.hpp>.

// The scale of a row of n values for a symmetric integer format whose largest code is `top`:
// max |x_i| / top, NaN when a value is not finite.
KVC_HOST_DEVICE inline float symmetric_row_scale(const float* x, std::int64_t n, float top) noexcept {
  float amax = 0.0f;
  bool finite = true;
  for (std::int64_t i = 0; i < n; ++i) {
    const float a = abs_float(x[i]);
    finite = finite && is_finite_float(a);
    amax = fmaxf(amax, a);
  }
  return finite ? amax / top : std::numeric_limits<float>::quiet_NaN();
}
// The code of x for `scale` (0 where the scale is 0 or NaN), rounded to nearest even, in [-top, top].
KVC_HOST_DEVICE inline int symmetric_code(float x, float scale, float top) noexcept {
  if (!(scale > 0.0f)) return 0;
  return static_cast<int>(fminf(fmaxf(nearbyintf(x / scale), -top), top));
}
// A row's float scale and a bfloat16's two bytes, little-endian at any alignment (the byte order
// of the hosts kvc builds for and of CUDA devices).
KVC_HOST_DEVICE inline void put_scale(std::uint8_t* at, float scale) noexcept {
  const std::uint32_t u = bits_of_float(scale);
  for (int i = 0; i < 4; ++i) at[i] = static_cast<std::uint8_t>(u >> (8 * i));
}
KVC_HOST_DEVICE inline float get_scale(const std::uint8_t* at) noexcept {
  return float_of_bits(std::uint32_t{at[0]} | std::uint32_t{at[1]} << 8 | std::uint32_t{at[2]} << 16 |
                       std::uint32_t{at[3]} << 24);
}

}  // namespace detail

// One byte of a row of int8 codes with its float scale (see the top of <kvc/row_codes.hpp>).
struct int8_row {
  // The byte.
  std::uint8_t bits = 0;
  // Its name in saved states and messages.
  static constexpr std::string_view name = "int8_row";
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = false;
  // The bytes of one head's row of head_dim values: head_dim codes and a float scale.
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept { return head_dim + 4; }
  // The row of x[0, n) into out[0, row_bytes(n)).
  KVC_HOST_DEVICE static void encode(const float* x, std::int64_t n, float /*tensor_scale*/, int8_row* out) noexcept {
    auto* b = reinterpret_cast<std::uint8_t*>(out);
    const float scale = detail::symmetric_row_scale(x, n, 127.0f);
    for (std::int64_t i = 0; i < n; ++i)
      b[i] = static_cast<std::uint8_t>(static_cast<std::int8_t>(detail::symmetric_code(x[i], scale, 127.0f)));
    detail::put_scale(b + n, scale);
  }
  // The n values of a row (the tensor scale not applied).
  static void widen(const int8_row* row, float* out, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    const float scale = detail::get_scale(b + n);
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<std::int8_t>(b[i])) * scale;
  }
  // Value i of a row of n, as widen gives it (host and device code: the device attention reads
  // rows this way, a value per lane).
  KVC_HOST_DEVICE static float value_at(const int8_row* row, std::int64_t i, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    return static_cast<float>(static_cast<std::int8_t>(b[i])) * detail::get_scale(b + n);
  }
};

// One byte of a row of int4 codes with its float scale (see the top of <kvc/row_codes.hpp>).
struct int4_row {
  // The byte.
  std::uint8_t bits = 0;
  // Its name in saved states and messages.
  static constexpr std::string_view name = "int4_row";
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = false;
  // The bytes of one head's row of head_dim values: two codes a byte and a float scale.
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept { return (head_dim + 1) / 2 + 4; }
  // The row of x[0, n) into out[0, row_bytes(n)).
  KVC_HOST_DEVICE static void encode(const float* x, std::int64_t n, float /*tensor_scale*/, int4_row* out) noexcept {
    auto* b = reinterpret_cast<std::uint8_t*>(out);
    const float scale = detail::symmetric_row_scale(x, n, 7.0f);
    for (std::int64_t i = 0; i < n; i += 2) {
      const auto lo = static_cast<unsigned>(detail::symmetric_code(x[i], scale, 7.0f)) & 0x0Fu;
      const auto hi = i + 1 < n ? static_cast<unsigned>(detail::symmetric_code(x[i + 1], scale, 7.0f)) & 0x0Fu : 0u;
      b[i / 2] = static_cast<std::uint8_t>(lo | (hi << 4));
    }
    detail::put_scale(b + (n + 1) / 2, scale);
  }
  // The n values of a row (the tensor scale not applied).
  static void widen(const int4_row* row, float* out, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    const float scale = detail::get_scale(b + (n + 1) / 2);
    const std::int64_t pairs = n / 2;
    for (std::int64_t i = 0; i < pairs; ++i) {
      const int byte = b[i];
      out[2 * i] = static_cast<float>(((byte & 0x0F) ^ 0x08) - 0x08) * scale;
      out[2 * i + 1] = static_cast<float>(((byte >> 4) ^ 0x08) - 0x08) * scale;
    }
    if (n % 2 != 0) out[n - 1] = static_cast<float>(((b[pairs] & 0x0F) ^ 0x08) - 0x08) * scale;
  }
  // Value i of a row of n, as widen gives it (host and device code).
  KVC_HOST_DEVICE static float value_at(const int4_row* row, std::int64_t i, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    const int code = (((i % 2 != 0 ? b[i / 2] >> 4 : b[i / 2]) & 0x0F) ^ 0x08) - 0x08;
    return static_cast<float>(code) * detail::get_scale(b + (n + 1) / 2);
  }
};

namespace detail {
// x rounded to bfloat16 (nearest even) and back to float; NaN stays NaN.
KVC_HOST_DEVICE inline float round_to_bfloat16(float x) noexcept {
  std::uint32_t u = bits_of_float(x);
  u = is_nan_float(x) ? (u | 0x00400000u) & 0xFFFF0000u : (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return float_of_bits(u);
}
// x rounded to bfloat16 toward +infinity (up) or toward -infinity (down); NaN stays NaN.
KVC_HOST_DEVICE inline float round_to_bfloat16(float x, bool up) noexcept {
  std::uint32_t u = bits_of_float(x);
  if (is_nan_float(x) || (u & 0xFFFFu) == 0) return x;
  const bool negative = (u >> 31) != 0;
  u &= 0xFFFF0000u;                   // toward zero
  if (negative != up) u += 0x10000u;  // one step away from zero (past the largest: an infinity)
  return float_of_bits(u);
}
KVC_HOST_DEVICE inline void put_bfloat16(std::uint8_t* at, float x) noexcept {
  const std::uint32_t u = bits_of_float(x);
  at[0] = static_cast<std::uint8_t>(u >> 16);
  at[1] = static_cast<std::uint8_t>(u >> 24);
}
KVC_HOST_DEVICE inline float get_bfloat16(const std::uint8_t* at) noexcept {
  return float_of_bits((std::uint32_t{at[0]} | std::uint32_t{at[1]} << 8) << 16);
}
}  // namespace detail

// One byte of a row of 2-bit codes with a bfloat16 minimum and step per group of 32 values (see
// the top of <kvc/row_codes.hpp>).
struct int2_row {
  // The byte.
  std::uint8_t bits = 0;
  // Its name in saved states and messages.
  static constexpr std::string_view name = "int2_row";
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = false;
  // The values that share a minimum and a step (the last group of a row may be shorter).
  static constexpr std::int64_t group_size = 32;
  // The bytes of one head's row of head_dim values: four codes a byte, then a bfloat16 minimum and
  // a bfloat16 step per group.
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept {
    return (head_dim + 3) / 4 + 4 * ((head_dim + group_size - 1) / group_size);
  }
  // The row of x[0, n) into out[0, row_bytes(n)).
  KVC_HOST_DEVICE static void encode(const float* x, std::int64_t n, float /*tensor_scale*/, int2_row* out) noexcept {
    auto* b = reinterpret_cast<std::uint8_t*>(out);
    for (std::int64_t i = 0; i < (n + 3) / 4; ++i) b[i] = 0;
    std::uint8_t* groups = b + (n + 3) / 4;
    for (std::int64_t start = 0; start < n; start += group_size, groups += 4) {
      const std::int64_t end = n < start + group_size ? n : start + group_size;
      float lo = x[start], hi = x[start];
      bool finite = true;
      for (std::int64_t i = start; i < end; ++i) {
        finite = finite && detail::is_finite_float(x[i]);
        lo = x[i] < lo ? x[i] : lo;  // (not fminf / fmaxf: which of +0 and -0 they keep is not
        hi = x[i] > hi ? x[i] : hi;  // fixed, and the device encoder must write the host's bytes)
      }
      float m = detail::round_to_bfloat16(lo, false);                 // m <= every value
      float step = detail::round_to_bfloat16((hi - m) / 3.0f, true);  // m + 3 step >= every value
      // (m + 3 step is infinite or NaN whenever m or step is: m = -inf makes step +inf)
      if (!finite || !detail::is_finite_float(m + detail::mul_rn(3.0f, step)))
        m = step = std::numeric_limits<float>::quiet_NaN();
      detail::put_bfloat16(groups, m);
      detail::put_bfloat16(groups + 2, step);
      if (!(step > 0.0f)) continue;
      for (std::int64_t i = start; i < end; ++i) {
        const auto code = static_cast<unsigned>(fminf(fmaxf(nearbyintf((x[i] - m) / step), 0.0f), 3.0f));
        b[i / 4] = static_cast<std::uint8_t>(b[i / 4] | (code << (2 * (i % 4))));
      }
    }
  }
  // The n values of a row: minimum + code * step, group by group (code * step is exact: a 2-bit
  // code times a bfloat16), with AVX2 eight values at a time where the CPU has it
  // (detail::avx2_enabled), a table of the group's four values otherwise and for a last short group.
  static void widen(const int2_row* row, float* out, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    const std::uint8_t* groups = b + (n + 3) / 4;
    std::int64_t first = 0;
#if defined(KVC_X86_AVX2_DISPATCH)
    if (detail::avx2_enabled()) first = widen_avx2(b, groups, n, out);
#endif
    groups += 4 * (first / group_size);
    for (std::int64_t start = first; start < n; start += group_size, groups += 4) {
      const std::int64_t end = std::min(n, start + group_size);
      const float m = detail::get_bfloat16(groups), step = detail::get_bfloat16(groups + 2);
      const std::array<float, 4> v = {m + 0.0f * step, m + step, m + 2.0f * step, m + 3.0f * step};  // as AVX2 does
      std::int64_t i = start;
      for (const std::uint8_t* c = b + start / 4; i + 4 <= end; i += 4, ++c) {  // a group starts a byte
        out[i] = v[*c & 3u];
        out[i + 1] = v[(*c >> 2) & 3u];
        out[i + 2] = v[(*c >> 4) & 3u];
        out[i + 3] = v[*c >> 6];
      }
      for (; i < end; ++i) out[i] = v[(b[i / 4] >> (2 * (i % 4))) & 3u];
    }
  }
  // Value i of a row of n, as widen gives it (host and device code; m + code * step is exact to one
  // rounding, so a fused multiply-add gives the same).
  KVC_HOST_DEVICE static float value_at(const int2_row* row, std::int64_t i, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    const std::uint8_t* group = b + (n + 3) / 4 + 4 * (i / group_size);
    const auto code = static_cast<float>((b[i / 4] >> (2 * (i % 4))) & 3u);
    return detail::get_bfloat16(group) + code * detail::get_bfloat16(group + 2);
  }

 private:
#if defined(KVC_X86_AVX2_DISPATCH)
  // widen's whole groups with AVX2: two bytes of codes (eight values) broadcast to eight 32-bit
  // lanes, each lane shifted to its own code, widened to float, times the step plus the minimum.
  // Returns how many values it did.
  KVC_TARGET_AVX2 static std::int64_t widen_avx2(const std::uint8_t* codes, const std::uint8_t* groups, std::int64_t n,
                                                 float* out) noexcept {
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), three = _mm256_set1_epi32(3);
    std::int64_t start = 0;
    for (; start + group_size <= n; start += group_size, groups += 4) {
      const __m256 m = _mm256_set1_ps(detail::get_bfloat16(groups)),
                   step = _mm256_set1_ps(detail::get_bfloat16(groups + 2));
      for (std::int64_t q = 0; q < group_size; q += 8) {
        const std::uint8_t* c = codes + (start + q) / 4;
        const __m256i lanes = _mm256_set1_epi32(c[0] | (c[1] << 8));
        const __m256 code = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(lanes, shifts), three));
        _mm256_storeu_ps(out + start + q, _mm256_add_ps(m, _mm256_mul_ps(code, step)));
      }
    }
    return start;
  }
#endif
};

// One byte of a row of NVFP4 codes with its E4M3 block scales (see the top of <kvc/row_codes.hpp>).
struct nvfp4_row {
  // The byte.
  std::uint8_t bits = 0;
  // Its name in saved states and messages.
  static constexpr std::string_view name = "nvfp4_row";
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = true;
  // The bytes of one head's row of head_dim values: nvfp4_bytes(head_dim).
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept { return nvfp4_bytes(head_dim); }
  // The row of x[0, n) with tensor scale g (checked by the caller: positive, at most 2^116) into
  // out[0, row_bytes(n)): nvfp4_quantize's codes, then its scales' bits.
  KVC_HOST_DEVICE static void encode(const float* x, std::int64_t n, float tensor_scale, nvfp4_row* out) noexcept {
    auto* b = reinterpret_cast<std::uint8_t*>(out);
    std::uint8_t* scales = b + (n + 1) / 2;
    for (std::int64_t start = 0; start < n; start += nvfp4_block_size)
      detail::nvfp4_quantize_block(x + start, n - start < nvfp4_block_size ? n - start : nvfp4_block_size, tensor_scale,
                                   b + start / 2, scales[start / nvfp4_block_size]);
  }
  // The n values of a row with tensor scale 1 (paged_attention applies the pool's): with AVX2 a
  // whole block at a time (detail::avx2_enabled); otherwise, and for a last short block, each
  // byte's two values from a table of the 256 bytes' value pairs, times the block's scale.
  static void widen(const nvfp4_row* row, float* out, std::int64_t n) noexcept {
    static constexpr auto pairs = [] {
      std::array<std::array<float, 2>, 256> t{};
      for (std::size_t byte = 0; byte < 256; ++byte)
        t[byte] = {float4_e2m1::values()[byte & 0x0Fu], float4_e2m1::values()[byte >> 4]};
      return t;
    }();
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    const std::uint8_t* scales = b + (n + 1) / 2;
    const float* scale_values = float8_e4m3::values_table();
    std::int64_t start = 0;
#if defined(KVC_X86_AVX2_DISPATCH)
    if (detail::avx2_enabled()) start = widen_avx2(b, scales, scale_values, n, out);
#endif
    for (; start < n; start += nvfp4_block_size) {
      const float s = scale_values[scales[start / nvfp4_block_size]];
      const std::int64_t len = std::min(nvfp4_block_size, n - start), whole = len / 2;
      const std::uint8_t* codes = b + start / 2;
      float* o = out + start;
      for (std::int64_t j = 0; j < whole; ++j) {
        const auto& p = pairs[codes[j]];
        o[2 * j] = p[0] * s;
        o[2 * j + 1] = p[1] * s;
      }
      if (len % 2 != 0) o[len - 1] = pairs[codes[whole]][0] * s;
    }
  }
  // Value i of a row of n with tensor scale 1, as widen gives it (host and device code): the E2M1
  // code's value from its bits (magnitude codes 2 to 7 are 2^(e - 1) times 1 or 1.5, code 1 is 0.5)
  // times the block's E4M3 scale.
  KVC_HOST_DEVICE static float value_at(const nvfp4_row* row, std::int64_t i, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    const std::uint32_t code = (i % 2 != 0 ? b[i / 2] >> 4 : b[i / 2]) & 0x0Fu, m = code & 0x07u;
    const std::uint32_t magnitude = m < 2 ? m * 0x3F000000u : ((m >> 1) + 126u) << 23 | (m & 1u) << 22;
    return detail::float_of_bits(magnitude | (code & 0x08u) << 28) *
           float8_e4m3::format::decode(b[(n + 1) / 2 + i / nvfp4_block_size]);
  }

 private:
#if defined(KVC_X86_AVX2_DISPATCH)
  // widen's whole blocks with AVX2: each block's codes as their doubled values (integers, -12 to
  // 12) by a byte shuffle, widened to float and times the block's scale / 2 (exact: the products
  // are the values' own). Returns how many values it did.
  KVC_TARGET_AVX2 static std::int64_t widen_avx2(const std::uint8_t* codes, const std::uint8_t* scales,
                                                 const float* scale_values, std::int64_t n, float* out) noexcept {
    const __m128i doubled = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    std::int64_t start = 0;
    for (; start + nvfp4_block_size <= n; start += nvfp4_block_size) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + start / 2));
      const __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
      const __m128i v = _mm_shuffle_epi8(doubled, _mm_unpacklo_epi8(lo, hi));  // value 2i, then 2i + 1
      const __m256 half_s = _mm256_set1_ps(0.5f * scale_values[scales[start / nvfp4_block_size]]);
      _mm256_storeu_ps(out + start, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), half_s));
      _mm256_storeu_ps(out + start + 8,
                       _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), half_s));
    }
    return start;
  }
#endif
};

namespace detail {

// Names joined at compile time: the characters of the parts one after the other (N at least their
// total length).
template <std::size_t N>
struct joined_name {
  std::array<char, N> chars{};
  std::size_t size = 0;
  constexpr std::string_view view() const noexcept { return {chars.data(), size}; }
};
template <std::size_t N>
constexpr joined_name<N> join_names(std::initializer_list<std::string_view> parts) noexcept {
  joined_name<N> out;
  for (const std::string_view p : parts)
    for (const char c : p) out.chars[out.size++] = c;
  return out;
}

template <class F8>
inline constexpr std::string_view fp8_row_name = std::is_same_v<F8, float8_e4m3> ? "fp8_e4m3_row" : "fp8_e5m2_row";

}  // namespace detail

// One byte of a row of fp8 codes with its float scale (vLLM's fp8_per_token_head; see the top of
// <kvc/row_codes.hpp>). F8 is kvc::float8_e4m3 or kvc::float8_e5m2.
template <class F8>
struct fp8_row {
  static_assert(is_float8_v<F8>, "kvc::fp8_row<F8>: F8 must be kvc::float8_e4m3 or kvc::float8_e5m2");
  // The byte.
  std::uint8_t bits = 0;
  // Its name in saved states and messages ("fp8_e4m3_row", "fp8_e5m2_row").
  static constexpr std::string_view name = detail::fp8_row_name<F8>;
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = false;
  // The largest finite code value (448 for E4M3, 57344 for E5M2).
  KVC_HOST_DEVICE static float top() noexcept { return F8::format::decode(F8::format::max_finite); }
  // The bytes of one head's row of head_dim values: head_dim codes and a float scale.
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept { return head_dim + 4; }
  // The row of x[0, n) into out[0, row_bytes(n)): scale = max |x_i| / top(), code_i = F8(x_i /
  // scale) (rounded to nearest even); codes 0 where the scale is 0 or NaN.
  KVC_HOST_DEVICE static void encode(const float* x, std::int64_t n, float /*tensor_scale*/, fp8_row* out) noexcept {
    auto* b = reinterpret_cast<std::uint8_t*>(out);
    const float scale = detail::symmetric_row_scale(x, n, top());
    for (std::int64_t i = 0; i < n; ++i)
      b[i] = scale > 0.0f ? F8::format::encode(x[i] / scale, fp8_overflow::saturate) : std::uint8_t{0};
    detail::put_scale(b + n, scale);
  }
  // The n values of a row: each code's value times the row's scale.
  static void widen(const fp8_row* row, float* out, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    const float scale = detail::get_scale(b + n);
    F8::widen(reinterpret_cast<const F8*>(b), out, n);
    for (std::int64_t i = 0; i < n; ++i) out[i] *= scale;
  }
  // Value i of a row of n, as widen gives it (host and device code).
  KVC_HOST_DEVICE static float value_at(const fp8_row* row, std::int64_t i, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    return F8::format::decode(b[i]) * detail::get_scale(b + n);
  }
};

// One byte of a row of bfloat16 values (the upper 16 bits of each float, rounded to nearest even,
// two bytes a value in the host's byte order): keys or values kept at 16 bits beside a low-bit
// partner in a kvc::kv_codes pool.
struct bfloat16_row {
  // The byte.
  std::uint8_t bits = 0;
  // Its name in saved states and messages.
  static constexpr std::string_view name = "bfloat16_row";
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = false;
  // The bytes of one head's row of head_dim values: two a value.
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept { return 2 * head_dim; }
  // The row of x[0, n) into out[0, row_bytes(n)); a NaN stays a (quiet) NaN.
  KVC_HOST_DEVICE static void encode(const float* x, std::int64_t n, float /*tensor_scale*/,
                                     bfloat16_row* out) noexcept {
    auto* b = reinterpret_cast<std::uint8_t*>(out);
    for (std::int64_t i = 0; i < n; ++i) detail::put_bfloat16(b + 2 * i, detail::round_to_bfloat16(x[i]));
  }
  // The n values of a row (exact: a bfloat16 is the upper half of a float).
  static void widen(const bfloat16_row* row, float* out, std::int64_t n) noexcept {
    const auto* b = reinterpret_cast<const std::uint8_t*>(row);
    for (std::int64_t i = 0; i < n; ++i) out[i] = detail::get_bfloat16(b + 2 * i);
  }
  // Value i of a row (host and device code).
  KVC_HOST_DEVICE static float value_at(const bfloat16_row* row, std::int64_t i, std::int64_t /*n*/) noexcept {
    return detail::get_bfloat16(reinterpret_cast<const std::uint8_t*>(row) + 2 * i);
  }
};

// One byte of a row of C codes (int8_row, int4_row, int2_row, nvfp4_row or fp8_row<F8>) made from the row rotated by
// kvc::hadamard_rotate first (<kvc/rotation.hpp>): an outlier channel is spread over the row, so
// the row's scale no longer has to cover it. to_row_codes rotates each row before encoding it and
// from_row_codes rotates the values back; paged_attention over a pool of rotated codes rotates the
// step's queries the same way (the scores are unchanged) and rotates the output back (the values
// were rotated too). `PagedCache<HostStorage<kvc::rotated<kvc::int4_row>>>`.
template <class C>
struct rotated;

namespace detail {
template <class C>
inline constexpr auto rotated_name = join_names<C::name.size() + 8>({"rotated_", C::name});
}  // namespace detail

template <class C>
struct rotated {
  // Whether C can be rotated (the names below read C only then: one misuse, one error).
  static constexpr bool rotatable =
      detail::is_any_of<C, int8_row, int4_row, int2_row, nvfp4_row, fp8_row<float8_e4m3>, fp8_row<float8_e5m2>>;
  static_assert(rotatable,
                "kvc::rotated<C>: C must be kvc::int8_row, int4_row, int2_row, nvfp4_row or kvc::fp8_row<F8>");
  // The byte.
  std::uint8_t bits = 0;
  // The codes' format.
  using codes = C;
  // Its name in saved states and messages ("rotated_int4_row", ...).
  static constexpr std::string_view name = detail::rotated_name<std::conditional_t<rotatable, C, int8_row>>.view();
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = std::conditional_t<rotatable, C, int8_row>::tensor_scaled;
  // The bytes of one head's row of head_dim values: C's.
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept { return C::row_bytes(head_dim); }
  // The row of x[0, n), already rotated, into out[0, row_bytes(n)): C's codes.
  static void encode(const float* x, std::int64_t n, float tensor_scale, rotated* out) {
    C::encode(x, n, tensor_scale, reinterpret_cast<C*>(out));
  }
  // The n values of a row, still rotated (the tensor scale not applied).
  static void widen(const rotated* row, float* out, std::int64_t n) noexcept {
    C::widen(reinterpret_cast<const C*>(row), out, n);
  }
  // Value i of a row, still rotated (host and device code).
  KVC_HOST_DEVICE static float value_at(const rotated* row, std::int64_t i, std::int64_t n) noexcept {
    return C::value_at(reinterpret_cast<const C*>(row), i, n);
  }
};

namespace detail {
template <class T>
inline constexpr bool is_rotated_row_code = false;
template <class C>
inline constexpr bool is_rotated_row_code<rotated<C>> = true;
// Whether every C is one trivially copyable byte.
template <class... C>
inline constexpr bool are_bytes = ((sizeof(C) == 1 && alignof(C) == 1 && std::is_trivially_copyable_v<C>)&&...);
// Whether T is one row format (a kv_codes side): the types above, kvc::rotated ones included.
template <class T>
inline constexpr bool is_row_format =
    is_any_of<T, int8_row, int4_row, int2_row, nvfp4_row, fp8_row<float8_e4m3>, fp8_row<float8_e5m2>, bfloat16_row> ||
    is_rotated_row_code<T>;
}  // namespace detail

template <class K, class V>
struct kv_codes;

namespace detail {
template <class K, class V>
inline constexpr auto kv_codes_name =
    join_names<K::name.size() + V::name.size() + 12>({"kv_codes<", K::name, ", ", V::name, ">"});
}  // namespace detail

// One byte of a pool whose keys are rows of format K and values rows of format V, each any of the
// row formats above (int8_row, int4_row, int2_row, nvfp4_row, fp8_row<F8>, bfloat16_row, kvc::rotated<C>),
// chosen independently: `PagedCache<HostStorage<kvc::kv_codes<kvc::fp8_row<kvc::float8_e4m3>,
// kvc::int4_row>>>` keeps fp8 keys and int4 values. The key pools' rows are K::row_bytes(head_dim)
// wide and the value pools' V::row_bytes(head_dim) (PagedCache::row_width(), value_row_width());
// kvc::to_kv_codes encodes a step's keys and values, paged_attention reads each side from its codes.
template <class K, class V>
struct kv_codes {
  // Whether K and V are row formats (the name below reads them only then: one misuse, one error).
  static constexpr bool formats = detail::is_row_format<K> && detail::is_row_format<V>;
  static_assert(formats,
                "kvc::kv_codes<K, V>: K and V must each be a row format: kvc::int8_row, int4_row, int2_row, nvfp4_row, "
                "fp8_row<F8>, bfloat16_row or kvc::rotated<one>");
  // The byte.
  std::uint8_t bits = 0;
  // The keys' format.
  using key_codes = K;
  // The values' format.
  using value_codes = V;
  // Its name in saved states and messages ("kv_codes<fp8_e4m3_row, int4_row>", ...).
  static constexpr std::string_view name =
      detail::kv_codes_name<std::conditional_t<formats, K, int8_row>, std::conditional_t<formats, V, int8_row>>.view();
};

static_assert(detail::are_bytes<int8_row, int4_row, int2_row, nvfp4_row, fp8_row<float8_e4m3>, fp8_row<float8_e5m2>,
                                bfloat16_row, rotated<int8_row>, rotated<int4_row>, rotated<nvfp4_row>,
                                rotated<fp8_row<float8_e4m3>>, kv_codes<int8_row, int4_row>>,
              "row codes are bytes: a row of them is the bytes of its codes and scales");

namespace detail {
template <class T>
struct kv_code_sides {
  using key = T;
  using value = T;
};
template <class K, class V>
struct kv_code_sides<kv_codes<K, V>> {
  using key = K;
  using value = V;
};
template <class T>
inline constexpr bool is_kv_codes = false;
template <class K, class V>
inline constexpr bool is_kv_codes<kv_codes<K, V>> = true;
}  // namespace detail

// Whether T is an element type of pools of row codes: one row format (above; kvc::rotated ones
// included) or a kvc::kv_codes pair of them.
template <class T>
inline constexpr bool is_row_code_v =
    detail::is_row_format<std::remove_cv_t<T>> || detail::is_kv_codes<std::remove_cv_t<T>>;

namespace detail {

// The format of a pool of T's keys and of its values: K and V for kv_codes<K, V>, T itself
// otherwise.
template <class T>
using key_format_t = typename kv_code_sides<std::remove_cv_t<T>>::key;
template <class T>
using value_format_t = typename kv_code_sides<std::remove_cv_t<T>>::value;

// The elements one head's row of head_dim values takes in a pool of T: head_dim, or the bytes of
// the codes and scales.
template <class T>
constexpr std::int64_t stored_row_width(std::int64_t head_dim) noexcept {
  if constexpr (is_row_code_v<T>)
    return T::row_bytes(head_dim);
  else
    return head_dim;
}
// The same for a pool's key rows and value rows (a kv_codes pool's sides differ).
template <class T>
constexpr std::int64_t stored_key_width(std::int64_t head_dim) noexcept {
  return stored_row_width<key_format_t<T>>(head_dim);
}
template <class T>
constexpr std::int64_t stored_value_width(std::int64_t head_dim) noexcept {
  return stored_row_width<value_format_t<T>>(head_dim);
}
// Whether a pool of T rotates its keys or its values (kvc::rotated formats).
template <class T>
inline constexpr bool rotates_keys = is_rotated_row_code<key_format_t<T>>;
template <class T>
inline constexpr bool rotates_values = is_rotated_row_code<value_format_t<T>>;
// Whether a row format F takes a tensor scale (NVFP4's); false for a type that is no row format.
template <class F>
inline constexpr bool format_tensor_scaled = [] {
  if constexpr (is_row_format<F>)
    return F::tensor_scaled;
  else
    return false;
}();
// Whether a pool of T's keys or values take a tensor scale.
template <class T>
inline constexpr bool key_tensor_scaled = format_tensor_scaled<key_format_t<T>>;
template <class T>
inline constexpr bool value_tensor_scaled = format_tensor_scaled<value_format_t<T>>;

}  // namespace detail

// The tensor scales of an NVFP4 pool's keys and values, for paged_attention (the integer formats
// need none: their scales are in the rows).
struct Nvfp4TensorScales {
  // The keys' tensor scale.
  float keys = 1.0f;
  // The values' tensor scale.
  float values = 1.0f;
  // The key scale of every KV head.
  float key_scale(std::int64_t) const noexcept { return keys; }
  // The value scale of every KV head.
  float value_scale(std::int64_t) const noexcept { return values; }
};

}  // namespace kvc
