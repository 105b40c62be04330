#pragma once
// kvc::int8_row, kvc::int4_row and kvc::nvfp4_row: the element types of paged pools whose rows
// carry their own scales (vLLM's kv_cache_dtype int8_per_token_head, int4_per_token_head and
// nvfp4). A pool of one of them, `PagedCache<HostStorage<kvc::int4_row>>`, stores each token's
// row of each KV head, head_dim values, as row_bytes(head_dim) bytes: the codes, then the scales.
//
//   int8_row   head_dim signed 8-bit codes, then one float scale (4 bytes, little-endian as the
//              host's float): scale = max |x_i| / 127, code_i = x_i / scale rounded to nearest
//              (ties to even) in [-127, 127]; value_i = code_i * scale. head_dim + 4 bytes
//              (0.52 of fp16 at head_dim 128).
//   int4_row   signed 4-bit codes two per byte (value 2i in the low 4 bits of byte i, 2i + 1 in the
//              high 4, two's complement), then one float scale: scale = max |x_i| / 7, code_i in
//              [-7, 7]. ceil(head_dim / 2) + 4 bytes (0.27 of fp16 at 128).
//   nvfp4_row  NVFP4 (<kvc/nvfp4.hpp>): E2M1 codes two per byte, then one E4M3 scale per 16
//              values; the tensor scale is the pool's, given when rows are encoded and to
//              paged_attention. nvfp4_bytes(head_dim) bytes (0.28 of fp16 at 128).
//
// A row of zeros gets scale 0 and codes 0. In the integer formats a row with a value that is not
// finite gets a NaN scale: it reads back as NaN. NVFP4 rows are nvfp4_quantize's: a NaN gives its
// 16-value block the NaN scale, an infinity saturates (the block scale 448, the code +-6).
//
// The pool then holds rows of codes: update() and paged_attention take the step's keys and values
// as the codes kvc::to_row_codes made, [1, kv_heads, tokens, row_bytes(head_dim)], and the cache
// moves them as bytes (forks, offload, save and load). paged_attention reads them from the pool
// and widens each block of rows to float as it reads it (docs/paged.md, "Quantized pages").
// kvc::rotated<C> is C made from Walsh-Hadamard-rotated rows (rotation composed with the format).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <kvc/detail/simd.hpp>
#include <kvc/detail/traits.hpp>
#include <kvc/errors.hpp>
#include <kvc/float8.hpp>
#include <kvc/nvfp4.hpp>
#include <kvc/rotation.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {

// The scale of a row of n values for a symmetric integer format whose largest code is `top`:
// max |x_i| / top, NaN when a value is not finite.
inline float symmetric_row_scale(const float* x, std::int64_t n, float top) noexcept {
  float amax = 0.0f;
  bool finite = true;
  for (std::int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    finite = finite && std::isfinite(a);
    amax = std::fmax(amax, a);
  }
  return finite ? amax / top : std::numeric_limits<float>::quiet_NaN();
}
// The code of x for `scale` (0 where the scale is 0 or NaN), rounded to nearest even, in [-top, top].
inline int symmetric_code(float x, float scale, float top) noexcept {
  if (!(scale > 0.0f)) return 0;
  return static_cast<int>(std::fmin(std::fmax(std::nearbyint(x / scale), -top), top));
}
inline void put_scale(std::uint8_t* at, float scale) noexcept { std::memcpy(at, &scale, sizeof scale); }
inline float get_scale(const std::uint8_t* at) noexcept {
  float s;
  std::memcpy(&s, at, sizeof s);
  return s;
}

}  // namespace detail

// One byte of a row of int8 codes with its float scale (see the top of <kvc/row_codes.hpp>).
struct int8_row {
  // The byte.
  std::uint8_t bits = 0;
  // Its name in saved states and messages.
  static constexpr std::string_view name = "int8_row";
  // The name of kvc::rotated<int8_row>.
  static constexpr std::string_view rotated_name = "rotated_int8_row";
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = false;
  // Whether rows are rotated before they are encoded (kvc::rotated).
  static constexpr bool rotates = false;
  // The bytes of one head's row of head_dim values: head_dim codes and a float scale.
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept { return head_dim + 4; }
  // The row of x[0, n) into out[0, row_bytes(n)).
  static void encode(const float* x, std::int64_t n, float /*tensor_scale*/, int8_row* out) noexcept {
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
};

// One byte of a row of int4 codes with its float scale (see the top of <kvc/row_codes.hpp>).
struct int4_row {
  // The byte.
  std::uint8_t bits = 0;
  // Its name in saved states and messages.
  static constexpr std::string_view name = "int4_row";
  // The name of kvc::rotated<int4_row>.
  static constexpr std::string_view rotated_name = "rotated_int4_row";
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = false;
  // Whether rows are rotated before they are encoded (kvc::rotated).
  static constexpr bool rotates = false;
  // The bytes of one head's row of head_dim values: two codes a byte and a float scale.
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept { return (head_dim + 1) / 2 + 4; }
  // The row of x[0, n) into out[0, row_bytes(n)).
  static void encode(const float* x, std::int64_t n, float /*tensor_scale*/, int4_row* out) noexcept {
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
};

// One byte of a row of NVFP4 codes with its E4M3 block scales (see the top of <kvc/row_codes.hpp>).
struct nvfp4_row {
  // The byte.
  std::uint8_t bits = 0;
  // Its name in saved states and messages.
  static constexpr std::string_view name = "nvfp4_row";
  // The name of kvc::rotated<nvfp4_row>.
  static constexpr std::string_view rotated_name = "rotated_nvfp4_row";
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = true;
  // Whether rows are rotated before they are encoded (kvc::rotated).
  static constexpr bool rotates = false;
  // The bytes of one head's row of head_dim values: nvfp4_bytes(head_dim).
  static constexpr std::int64_t row_bytes(std::int64_t head_dim) noexcept { return nvfp4_bytes(head_dim); }
  // The row of x[0, n) with tensor scale g (checked by the caller: positive, at most 2^116) into
  // out[0, row_bytes(n)): nvfp4_quantize's codes, then its scales' bits.
  static void encode(const float* x, std::int64_t n, float tensor_scale, nvfp4_row* out) {
    auto* b = reinterpret_cast<std::uint8_t*>(out);
    std::uint8_t* scales = b + (n + 1) / 2;
    for (std::int64_t start = 0; start < n; start += nvfp4_block_size) {
      float8_e4m3 s;
      nvfp4_quantize(x + start, std::min(nvfp4_block_size, n - start), tensor_scale, b + start / 2, &s);
      scales[start / nvfp4_block_size] = s.bits;
    }
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

// One byte of a row of C codes (int8_row, int4_row or nvfp4_row) made from the row rotated by
// kvc::hadamard_rotate first (<kvc/rotation.hpp>): an outlier channel is spread over the row, so
// the row's scale no longer has to cover it. to_row_codes rotates each row before encoding it and
// from_row_codes rotates the values back; paged_attention over a pool of rotated codes rotates the
// step's queries the same way (the scores are unchanged) and rotates the output back (the values
// were rotated too). `PagedCache<HostStorage<kvc::rotated<kvc::int4_row>>>`.
template <class C>
struct rotated {
  static_assert(detail::is_any_of<C, int8_row, int4_row, nvfp4_row>,
                "kvc::rotated<C>: C must be kvc::int8_row, int4_row or nvfp4_row");
  // The byte.
  std::uint8_t bits = 0;
  // The codes' format.
  using codes = C;
  // Its name in saved states and messages ("rotated_int4_row", ...).
  static constexpr std::string_view name = C::rotated_name;
  // Whether rows take a tensor scale (NVFP4's) when encoded.
  static constexpr bool tensor_scaled = C::tensor_scaled;
  // Whether rows are rotated before they are encoded: yes.
  static constexpr bool rotates = true;
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
};

namespace detail {
template <class T>
inline constexpr bool is_rotated_row_code = false;
template <class C>
inline constexpr bool is_rotated_row_code<rotated<C>> = true;
}  // namespace detail

namespace detail {
// Whether every C is one trivially copyable byte.
template <class... C>
inline constexpr bool are_bytes = ((sizeof(C) == 1 && alignof(C) == 1 && std::is_trivially_copyable_v<C>)&&...);
}  // namespace detail
static_assert(
    detail::are_bytes<int8_row, int4_row, nvfp4_row, rotated<int8_row>, rotated<int4_row>, rotated<nvfp4_row>>,
    "row codes are bytes: a row of them is the bytes of its codes and scales");

// Whether T is one of the row-code element types above (kvc::rotated ones included).
template <class T>
inline constexpr bool is_row_code_v = detail::is_any_of<std::remove_cv_t<T>, int8_row, int4_row, nvfp4_row> ||
                                      detail::is_rotated_row_code<std::remove_cv_t<T>>;

namespace detail {

// The elements one head's row of head_dim values takes in a pool of T: head_dim, or the bytes of
// the codes and scales.
template <class T>
constexpr std::int64_t stored_row_width(std::int64_t head_dim) noexcept {
  if constexpr (is_row_code_v<T>)
    return T::row_bytes(head_dim);
  else
    return head_dim;
}

}  // namespace detail

namespace detail {

template <class C, class X>
HostTensor<C> row_codes_of(const X& input, float tensor_scale) {
  static_assert(is_row_code_v<C>,
                "kvc::to_row_codes: the code type must be kvc::int8_row, int4_row, nvfp4_row or kvc::rotated<one>");
  if constexpr (!require_inputs<input_in<X, memory_space::host>, X>()) {
    return {};
  } else {
    if constexpr (C::tensor_scaled) check_nvfp4_tensor_scale(tensor_scale, "kvc::to_row_codes");
    const auto x = input_view(input);
    const std::int64_t d = x.extent(3), w = C::row_bytes(d);
    HostTensor<C> out(x.extent(0), x.extent(1), x.extent(2), w);
    std::vector<float> row(static_cast<std::size_t>(d));
    C* o = out.data();
    for (std::int64_t b = 0; b < x.extent(0); ++b)
      for (std::int64_t h = 0; h < x.extent(1); ++h)
        for (std::int64_t s = 0; s < x.extent(2); ++s, o += w) {
          for (std::int64_t i = 0; i < d; ++i) row[static_cast<std::size_t>(i)] = static_cast<float>(x(b, h, s, i));
          if constexpr (C::rotates) hadamard_rotate(row.data(), 1, d);
          C::encode(row.data(), d, tensor_scale, o);
        }
    return out;
  }
}

}  // namespace detail

// x [batch, heads, seq, head_dim] (any kvc::tensor_input on the host, of any element type a float
// converts from) as rows of C codes: [batch, heads, seq, C::row_bytes(head_dim)], each row encoded
// alone (NVFP4 with tensor scale 1).
template <class C, class X>
HostTensor<C> to_row_codes(const X& input) {
  return detail::row_codes_of<C>(input, 1.0f);
}
// The same as NVFP4 rows with the tensor scale `tensor_scale` (kvc::nvfp4_tensor_scale picks one
// from the largest magnitude): a ValueError unless it is positive and at most 2^116. The integer
// formats keep one scale per row and take no tensor scale.
template <class C, class X>
  requires(C::tensor_scaled)
HostTensor<C> to_row_codes(const X& input, float tensor_scale) {
  return detail::row_codes_of<C>(input, tensor_scale);
}

// The values of rows of C codes ([batch, heads, seq, C::row_bytes(head_dim)], any tensor_input of C
// on the host) as floats [batch, heads, seq, head_dim], times `tensor_scale` (NVFP4's; 1 for the
// integer formats). A ValueError when the rows are not row_bytes(head_dim) wide.
template <class C, class X>
HostTensor<float> from_row_codes(const X& input, std::int64_t head_dim, float tensor_scale = 1.0f) {
  static_assert(is_row_code_v<C>,
                "kvc::from_row_codes: the code type must be kvc::int8_row, int4_row, nvfp4_row or kvc::rotated<one>");
  if constexpr (!detail::require_inputs<detail::input_of<X, C, memory_space::host>, X>()) {
    return {};
  } else {
    const auto x = input_view(input);
    if (head_dim < 1 || x.extent(3) != C::row_bytes(head_dim))
      throw ValueError("kvc::from_row_codes: rows of " + std::to_string(head_dim) + " values are " +
                       std::to_string(head_dim < 1 ? 0 : C::row_bytes(head_dim)) + " " + std::string(C::name) +
                       " bytes wide, got " + std::to_string(x.extent(3)));
    HostTensor<float> out(x.extent(0), x.extent(1), x.extent(2), head_dim);
    std::vector<C> row(static_cast<std::size_t>(x.extent(3)));
    float* o = out.data();
    for (std::int64_t b = 0; b < x.extent(0); ++b)
      for (std::int64_t h = 0; h < x.extent(1); ++h)
        for (std::int64_t s = 0; s < x.extent(2); ++s, o += head_dim) {
          for (std::int64_t i = 0; i < x.extent(3); ++i) row[static_cast<std::size_t>(i)] = x(b, h, s, i);
          C::widen(row.data(), o, head_dim);
          if constexpr (C::rotates) hadamard_rotate(o, 1, head_dim);
          for (std::int64_t i = 0; i < head_dim; ++i) o[i] *= tensor_scale;
        }
    return out;
  }
}

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
