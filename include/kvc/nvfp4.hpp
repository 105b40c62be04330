#pragma once
// kvc::float4_e2m1 and the NVFP4 block codec: the 4-bit floating-point format NVIDIA's Blackwell
// GPUs compute with, and that FlashInfer and vLLM store KV caches in.
//
//   E2M1 (the FP4 element of the OCP Microscaling Formats specification, v1.0): sign, 2 exponent
//        bits (bias 1), 1 mantissa bit. The magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4 and 6 (codes
//        0 to 7; 8 to 15 are their negatives); no infinity, no NaN.
//   NVFP4: E2M1 codes in blocks of 16 values; each block has one scale, an E4M3 8-bit float
//        (kvc::float8_e4m3), and the whole tensor one float scale. A value is
//        e2m1 * float(block scale) * tensor scale: 4.5 bits per value (0.28 of fp16).
//
// Conversion to E2M1 rounds to nearest, ties to even, and saturates: beyond +-6 (infinities too)
// gives +-6, NaN gives +6, as CUDA's __nv_cvt_float_to_fp4 with cudaRoundNearest does; a result of
// zero keeps the input's sign. nvfp4_quantize's steps for one block of values x with tensor scale g
// (all in float arithmetic):
//   a     = max |x_i|                       (NaN when a value is NaN)
//   s     = float8_e4m3(a / (6 * g))        (round to nearest even, saturating at 448)
//   S     = float(s) * g                    (the block's scale)
//   q_i   = float4_e2m1(x_i / S)            (0 with x_i's sign where S is 0)
// and nvfp4_dequantize gives float(q_i) * S. A block with a NaN gets the NaN scale code, so all of
// it reads back as NaN. The codes mean what they mean in NVIDIA's format, so nvfp4_dequantize reads
// NVFP4 data from anywhere; NVIDIA's quantization kernels (TensorRT-LLM's, FlashInfer's) multiply by
// approximate reciprocals where these steps divide, so a value right at a rounding boundary may
// get the neighbouring code there, and a NaN changes only its own code.

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>

#include <math.h>  // fmaxf: one name in host and device code

#include <kvc/detail/host_device.hpp>
#include <kvc/errors.hpp>
#include <kvc/float8.hpp>

namespace kvc {

namespace detail {
// A float's bits and back, and the tests the codecs need, in host and device code alike (no libm).
KVC_HOST_DEVICE inline std::uint32_t bits_of_float(float x) noexcept { return float8_e4m3::format::float_to_bits(x); }
KVC_HOST_DEVICE inline float float_of_bits(std::uint32_t u) noexcept { return float8_e4m3::format::bits_to_float(u); }
KVC_HOST_DEVICE inline bool is_nan_float(float x) noexcept { return (bits_of_float(x) & 0x7FFFFFFFu) > 0x7F800000u; }
KVC_HOST_DEVICE inline bool is_finite_float(float x) noexcept {
  return (bits_of_float(x) & 0x7F800000u) != 0x7F800000u;
}
KVC_HOST_DEVICE inline float abs_float(float x) noexcept { return float_of_bits(bits_of_float(x) & 0x7FFFFFFFu); }
KVC_HOST_DEVICE inline bool sign_of_float(float x) noexcept { return (bits_of_float(x) >> 31) != 0; }
}  // namespace detail

// One E2M1 value: its code in the low 4 bits of a byte (bit 3 the sign).
struct float4_e2m1 {
  // The code: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa; bits 7-4 are 0.
  std::uint8_t bits = 0;

  constexpr float4_e2m1() noexcept = default;
  // Rounds to nearest even and saturates (see the top of <kvc/nvfp4.hpp>).
  explicit float4_e2m1(float x) noexcept : bits(encode(x)) {}

  // The value whose code is code's low 4 bits.
  static constexpr float4_e2m1 from_bits(std::uint8_t code) noexcept {
    float4_e2m1 f;
    f.bits = static_cast<std::uint8_t>(code & 0x0Fu);
    return f;
  }
  // The value, exact.
  explicit operator float() const noexcept { return decode(bits); }
  // The value, exact.
  float to_float() const noexcept { return decode(bits); }

  // The value of a code (its low 4 bits), exact.
  static constexpr float decode(std::uint8_t code) noexcept { return values()[code & 0x0Fu]; }
  // The values of the 16 codes, by code.
  static constexpr std::array<float, 16> values() noexcept {
    return {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  }
  // The code of a float. Each magnitude code is the number of rounding boundaries |x| has passed;
  // a tie goes to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, ...).
  // Host and device code.
  KVC_HOST_DEVICE static std::uint8_t encode(float x) noexcept {
    if (detail::is_nan_float(x)) return 0x07;
    const float a = detail::abs_float(x);
    const int code = int{a > 0.25f} + int{a >= 0.75f} + int{a > 1.25f} + int{a >= 1.75f} + int{a > 2.5f} +
                     int{a >= 3.5f} + int{a > 5.0f};
    return static_cast<std::uint8_t>((detail::sign_of_float(x) ? 0x08 : 0x00) | code);
  }

  // Bit equality (both zeros differ).
  friend constexpr bool operator==(float4_e2m1 a, float4_e2m1 b) noexcept { return a.bits == b.bits; }
};

// The values one NVFP4 block scale covers.
inline constexpr std::int64_t nvfp4_block_size = 16;

// The bytes n values take in NVFP4: n / 2 code bytes (rounded up) and one scale per 16 values
// (rounded up), the tensor scale not counted.
constexpr std::int64_t nvfp4_bytes(std::int64_t n) noexcept {
  return (n + 1) / 2 + (n + nvfp4_block_size - 1) / nvfp4_block_size;
}

namespace detail {

// ValueError "{method}: {what} must be positive and finite{limit}, got {v}" unless v is (and at
// most `most`, where a limit is named).
inline void check_nvfp4_positive(float v, std::string_view method, std::string_view what,
                                 float most = std::numeric_limits<float>::max(), std::string_view limit = {}) {
  if (v > 0.0f && v <= most) return;
  char digits[32];
  const auto end = std::to_chars(digits, digits + sizeof digits, v).ptr;
  throw ValueError(join_message({method, ": ", what, " must be positive and finite", limit, ", got ",
                                 std::string_view(digits, static_cast<std::size_t>(end - digits))}));
}

// The largest tensor scale, 2^116: the largest value NVFP4 codes can take, 6 * 448 * 2^116 (about
// 2.2e38), is a float, and every product on the way is exact.
inline constexpr float nvfp4_max_tensor_scale = 0x1p116f;
inline void check_nvfp4_tensor_scale(float g, std::string_view method) {
  check_nvfp4_positive(g, method, "the tensor scale", nvfp4_max_tensor_scale, " (at most 2^116)");
}

}  // namespace detail

// The tensor scale that maps amax, the largest magnitude the tensor will hold, onto the largest
// NVFP4 value (6 times E4M3's 448): amax / 2688, at least the smallest normal float and at most
// 2^116 (the largest tensor scale nvfp4_quantize takes). ValueError unless amax is positive and
// finite.
inline float nvfp4_tensor_scale(float amax) {
  detail::check_nvfp4_positive(amax, "kvc::nvfp4_tensor_scale", "amax");
  return std::fmin(std::fmax(amax / 2688.0f, std::numeric_limits<float>::min()), detail::nvfp4_max_tensor_scale);
}

namespace detail {
// One NVFP4 block of len <= 16 values (nvfp4_quantize's steps, below) with tensor scale g, already
// checked: its (len + 1) / 2 code bytes (the high half of a last odd byte 0) and its scale's bits.
// Host and device code.
KVC_HOST_DEVICE inline void nvfp4_quantize_block(const float* block, std::int64_t len, float g, std::uint8_t* codes,
                                                 std::uint8_t& scale_bits) noexcept {
  float a = 0.0f;
  bool nan = false;
  for (std::int64_t i = 0; i < len; ++i) {
    nan = nan || is_nan_float(block[i]);
    a = fmaxf(a, abs_float(block[i]));
  }
  scale_bits = nan ? std::uint8_t{0x7F} : float8_e4m3::format::encode(a / (6.0f * g), fp8_overflow::saturate);
  const float scale = float8_e4m3::format::decode(scale_bits) * g;
  const auto code = [&](std::int64_t i) -> unsigned {
    if (i >= len) return 0;
    return scale > 0.0f || nan ? float4_e2m1::encode(block[i] / scale) : (sign_of_float(block[i]) ? 0x08u : 0x00u);
  };
  for (std::int64_t i = 0; i < len; i += 2) codes[i / 2] = static_cast<std::uint8_t>(code(i) | (code(i + 1) << 4));
}
}  // namespace detail

// NVFP4 codes of x[0, n): codes[(n + 1) / 2] two per byte (value 2i in the low 4 bits of byte i,
// value 2i + 1 in the high 4; the high half of a last odd byte is 0), scales[(n + 15) / 16] one per
// 16 values (the last block may be shorter). ValueError unless the tensor scale is positive and at
// most 2^116 (so that the largest value the codes can take is a float); nothing is written then.
inline void nvfp4_quantize(const float* x, std::int64_t n, float tensor_scale, std::uint8_t* codes,
                           float8_e4m3* scales) {
  detail::check_nvfp4_tensor_scale(tensor_scale, "kvc::nvfp4_quantize");
  for (std::int64_t start = 0; start < n; start += nvfp4_block_size)
    detail::nvfp4_quantize_block(x + start, std::min(nvfp4_block_size, n - start), tensor_scale, codes + start / 2,
                                 scales[start / nvfp4_block_size].bits);
}

// The values of NVFP4 codes (as nvfp4_quantize writes them): out[i] = float(code i) * S, S the
// block's float(scale) * tensor_scale. ValueError unless the tensor scale is positive and at most
// 2^116.
inline void nvfp4_dequantize(const std::uint8_t* codes, const float8_e4m3* scales, std::int64_t n, float tensor_scale,
                             float* out) {
  detail::check_nvfp4_tensor_scale(tensor_scale, "kvc::nvfp4_dequantize");
  constexpr auto values = float4_e2m1::values();
  for (std::int64_t start = 0; start < n; start += nvfp4_block_size) {
    const std::int64_t len = std::min(nvfp4_block_size, n - start);
    const float scale = scales[start / nvfp4_block_size].to_float() * tensor_scale;
    for (std::int64_t i = 0; i < len; ++i) {
      const std::uint8_t byte = codes[(start + i) / 2];
      const auto code = static_cast<std::size_t>(((start + i) & 1) != 0 ? byte >> 4 : byte & 0x0F);
      out[start + i] = values[code] * scale;
    }
  }
}

}  // namespace kvc
