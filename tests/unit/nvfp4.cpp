// kvc::float4_e2m1 and the NVFP4 block codec (<kvc/nvfp4.hpp>) against the formats' definitions:
// every E2M1 code's value from its sign, exponent and mantissa bits; float -> code against a
// brute-force encoder (nearest value, ties to the even code, saturation) on every value, every
// midpoint and the floats either side of it, random floats and a sweep over the float bit
// patterns; where the CUDA toolkit's <cuda_fp4.h> is found, against its host conversion too; and
// nvfp4_quantize / nvfp4_dequantize, code by code and scale by scale, against the block steps the
// header documents, built from the brute-force encoder.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <kvc/nvfp4.hpp>

#if defined(KVC_TEST_CUDA_FP4)
#include <cuda_fp4.h>
#endif

#include "../support/float_inputs.hpp"

namespace {

// The value of an E2M1 code from its fields: exponent bias 1, exponent 0 subnormal.
double spec_value(std::uint8_t code) {
  const int s = (code >> 3) & 1, e = (code >> 1) & 3, m = code & 1;
  const double v = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
  return s ? -v : v;
}

// The brute-force encoder: the nearest of the 8 magnitudes (ties to the even code), saturating;
// NaN gives +6.
std::uint8_t reference_encode(float x) {
  if (std::isnan(x)) return 0x07;
  const double a = std::fabs(static_cast<double>(x));
  const auto sign = static_cast<std::uint8_t>(std::signbit(x) ? 0x08 : 0);
  if (a >= 6.0) return static_cast<std::uint8_t>(sign | 7);  // (far above 6, the distances would round equal)
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(a - spec_value(static_cast<std::uint8_t>(c)));
    const double best_d = std::fabs(a - spec_value(static_cast<std::uint8_t>(best)));
    if (d < best_d || (d == best_d && c % 2 == 0)) best = c;
  }
  return static_cast<std::uint8_t>(sign | best);
}

// The inputs the encoder is checked on.
std::vector<float> encoder_inputs() {
  std::vector<float> inputs;
  for (int c = 0; c < 16; ++c) inputs.push_back(static_cast<float>(spec_value(static_cast<std::uint8_t>(c))));
  std::vector<double> values;
  for (int c = 0; c < 8; ++c) values.push_back(spec_value(static_cast<std::uint8_t>(c)));
  values.push_back(8.0);  // a step past 6: 7 rounds to it, which saturates
  kvc_test::push_midpoints(inputs, values);
  kvc_test::push_special_floats(inputs);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-8.0f, 8.0f);
  for (int i = 0; i < 20000; ++i) inputs.push_back(uniform(rng));
  return inputs;
}

// What nvfp4_quantize must write for one block, from the steps the header documents, with the
// brute-force encoder: {codes, scale code}.
std::pair<std::vector<std::uint8_t>, std::uint8_t> reference_block(const float* x, std::int64_t len, float g) {
  float a = 0.0f;
  bool nan = false;
  for (std::int64_t i = 0; i < len; ++i) {
    if (std::isnan(x[i])) nan = true;
    if (std::fabs(x[i]) > a) a = std::fabs(x[i]);
  }
  const std::uint8_t scale_code = nan ? std::uint8_t{0x7F} : kvc::float8_e4m3(a / (6.0f * g)).bits;
  const float scale = kvc::float8_e4m3::from_bits(scale_code).to_float() * g;
  std::vector<std::uint8_t> q;
  for (std::int64_t i = 0; i < len; ++i)
    q.push_back(scale > 0.0f || nan ? reference_encode(x[i] / scale)
                                    : static_cast<std::uint8_t>(std::signbit(x[i]) ? 0x08 : 0));
  return {q, scale_code};
}

std::uint8_t code_at(const std::vector<std::uint8_t>& codes, std::int64_t i) {
  const std::uint8_t byte = codes[static_cast<std::size_t>(i / 2)];
  return static_cast<std::uint8_t>(i % 2 ? byte >> 4 : byte & 0x0F);
}

// Quantizes x with tensor scale g and checks every code, scale and read-back value against the
// reference; returns the values read back.
std::vector<float> check_codec(const std::vector<float>& x, float g) {
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<std::uint8_t> codes(static_cast<std::size_t>((n + 1) / 2), 0xAB);
  std::vector<kvc::float8_e4m3> scales(static_cast<std::size_t>((n + 15) / 16));
  kvc::nvfp4_quantize(x.data(), n, g, codes.data(), scales.data());
  std::vector<float> y(x.size());
  kvc::nvfp4_dequantize(codes.data(), scales.data(), n, g, y.data());
  int mismatches = 0;
  for (std::int64_t start = 0; start < n; start += 16) {
    const std::int64_t len = std::min<std::int64_t>(16, n - start);
    const auto [q, scale_code] = reference_block(x.data() + start, len, g);
    const float scale = kvc::float8_e4m3::from_bits(scale_code).to_float() * g;
    if (scales[static_cast<std::size_t>(start / 16)].bits != scale_code) ++mismatches;
    for (std::int64_t i = 0; i < len; ++i) {
      const std::uint8_t code = code_at(codes, start + i);
      if (code != q[static_cast<std::size_t>(i)]) ++mismatches;
      const float want = static_cast<float>(spec_value(code)) * scale;
      const float got = y[static_cast<std::size_t>(start + i)];
      if (std::bit_cast<std::uint32_t>(got) != std::bit_cast<std::uint32_t>(want) &&
          !(std::isnan(got) && std::isnan(want)))
        ++mismatches;
    }
  }
  if (n % 2) CHECK((codes.back() >> 4) == 0);  // the unused half of a last odd byte
  CHECK(mismatches == 0);
  return y;
}

}  // namespace

TEST_CASE("float4_e2m1: every code's value, and rounding against a brute-force encoder") {
  for (int c = 0; c < 16; ++c) {
    CAPTURE(c);
    const auto f = kvc::float4_e2m1::from_bits(static_cast<std::uint8_t>(c));
    CHECK(static_cast<double>(f.to_float()) == spec_value(static_cast<std::uint8_t>(c)));
    CHECK(std::signbit(static_cast<float>(f)) == (c >= 8));
    if (c > 0 && c < 8) CHECK(f.to_float() > kvc::float4_e2m1::from_bits(static_cast<std::uint8_t>(c - 1)).to_float());
  }
  CHECK(kvc::float4_e2m1::from_bits(0x1F) == kvc::float4_e2m1::from_bits(0x0F));  // the low 4 bits
  CHECK(kvc::float4_e2m1(0.25f).bits == 0x0);                                     // a tie: to the even code
  CHECK(kvc::float4_e2m1(0.75f).bits == 0x2);                                     // 1.0
  CHECK(kvc::float4_e2m1(5.0f).bits == 0x6);                                      // 4.0
  CHECK(kvc::float4_e2m1(-7.0f).bits == 0xF);                                     // saturates to -6
  CHECK(kvc::float4_e2m1(-0.1f).bits == 0x8);                                     // -0
  CHECK(kvc::float4_e2m1(-NAN).bits == 0x7);                                      // NaN: +6
  int mismatches = 0;
  for (const float x : encoder_inputs())
    if (kvc::float4_e2m1(x).bits != reference_encode(x)) {
      if (++mismatches < 5) MESSAGE("encode(" << x << ") gave " << int{kvc::float4_e2m1(x).bits});
    }
  CHECK(mismatches == 0);
}

#if defined(KVC_TEST_CUDA_FP4)
TEST_CASE("float4_e2m1 gives the codes and values of the CUDA toolkit's host conversion") {
  int mismatches = 0;
  for (const float x : encoder_inputs()) {
    const auto cuda = static_cast<std::uint8_t>(__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest));
    if (kvc::float4_e2m1(x).bits != cuda) ++mismatches;
  }
  for (int c = 0; c < 16; ++c) {
    __nv_fp4_e2m1 f;
    f.__x = static_cast<__nv_fp4_storage_t>(c);
    if (static_cast<float>(f) != kvc::float4_e2m1::from_bits(static_cast<std::uint8_t>(c)).to_float()) ++mismatches;
  }
  CHECK(mismatches == 0);
}
#endif

TEST_CASE("nvfp4_quantize / nvfp4_dequantize: every code and block scale as the format defines them") {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const std::int64_t n : {1, 2, 15, 16, 17, 33, 128, 1000}) {
    CAPTURE(n);
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& v : x) v = normal(rng);
    if (n >= 33) {
      x[3] = 40.0f;                                                         // an outlier: its block's scale is larger
      for (int i = 16; i < 32; ++i) x[static_cast<std::size_t>(i)] = 0.0f;  // an all-zero block
      x[20] = -0.0f;
    }
    float amax = 0.0f;
    for (const float v : x) amax = std::fmax(amax, std::fabs(v));
    for (const float g : {kvc::nvfp4_tensor_scale(amax), 1.0f, 1e-3f, 1e-30f}) {
      CAPTURE(g);
      const std::vector<float> y = check_codec(x, g);
      if (g == kvc::nvfp4_tensor_scale(amax)) {
        // With the tensor scale from amax, no block scale saturates; where the block scale is a
        // normal E4M3 value (relative error at most 1/16), each value reads back within its block's
        // largest magnitude / 16 plus half the E2M1 step at its magnitude (at most 1 scale unit).
        for (std::int64_t s = 0; s < n; s += 16) {
          float a = 0.0f;
          for (std::int64_t i = s; i < std::min<std::int64_t>(n, s + 16); ++i)
            a = std::fmax(a, std::fabs(x[static_cast<std::size_t>(i)]));
          if (a / (6.0f * g) < 1.0f / 64) continue;
          for (std::int64_t i = s; i < std::min<std::int64_t>(n, s + 16); ++i)
            CHECK(std::fabs(x[static_cast<std::size_t>(i)] - y[static_cast<std::size_t>(i)]) <= a / 6.0f * 1.0625f);
        }
      }
    }
  }

  // Blocks holding NaN, infinities, huge and tiny values.
  std::vector<float> x(48, 0.5f);
  x[2] = NAN;                                      // block 0: all NaN on reading back
  x[17] = std::numeric_limits<float>::infinity();  // block 1: the scale saturates at 448
  x[18] = -3e38f;
  x[33] = 1e-40f;  // block 2: a float subnormal, values 0.5
  const std::vector<float> y = check_codec(x, 1.0f);
  for (int i = 0; i < 16; ++i) CHECK(std::isnan(y[static_cast<std::size_t>(i)]));
  CHECK(y[17] == 448.0f * 6.0f);
  CHECK(y[18] == -448.0f * 6.0f);
  // The largest tensor scale: the largest magnitude reads back finite, exactly 6 * 448 * 2^116.
  const std::vector<float> big = check_codec(x, 0x1p116f);
  CHECK(big[17] == 2688.0f * 0x1p116f);
  CHECK(std::isfinite(big[18]));
  CHECK(big[19] == 0.0f);  // 0.5 is far below that block's scale
  // Worked by hand: a block of 1.0 with g = 1 has a / 6 = 0.1667, whose nearest E4M3 value is
  // 1.375 * 2^-3 = 0.171875 (code 0x23); 1 / 0.171875 = 5.8 rounds to E2M1's 6, read back 1.03125.
  const std::vector<float> ones(16, 1.0f);
  std::vector<std::uint8_t> one_codes(8);
  std::vector<kvc::float8_e4m3> one_scale(1);
  kvc::nvfp4_quantize(ones.data(), 16, 1.0f, one_codes.data(), one_scale.data());
  CHECK(one_scale[0].bits == 0x23);
  CHECK(one_codes == std::vector<std::uint8_t>(8, 0x77));
  CHECK(check_codec(ones, 1.0f) == std::vector<float>(16, 1.03125f));
  std::vector<float> tiny(16, 1e-12f);  // a/(6g) below E4M3's smallest subnormal: scale 0, codes 0
  tiny[5] = -1e-12f;
  const std::vector<float> z = check_codec(tiny, 1.0f);
  CHECK(z[0] == 0.0f);
  CHECK(std::signbit(z[5]));
}

TEST_CASE("NVFP4 takes 4.5 bits per value: 0.28 of fp16 for a 128-wide head") {
  CHECK(kvc::nvfp4_bytes(128) == 64 + 8);
  CHECK(static_cast<double>(kvc::nvfp4_bytes(128)) / (2.0 * 128) <= 0.29);
  CHECK(kvc::nvfp4_bytes(1) == 2);
  CHECK(kvc::nvfp4_bytes(17) == 9 + 2);
  CHECK(kvc::nvfp4_tensor_scale(2688.0f) == 1.0f);
  CHECK(kvc::nvfp4_tensor_scale(1e-40f) == std::numeric_limits<float>::min());
  // The largest amax gives the largest tensor scale nvfp4_quantize takes (FLT_MAX / 2688 is above it).
  const float top = kvc::nvfp4_tensor_scale(std::numeric_limits<float>::max());
  CHECK(top == 0x1p116f);
  std::vector<float> huge(16, std::numeric_limits<float>::max()), back(16);
  std::vector<std::uint8_t> codes(8);
  std::vector<kvc::float8_e4m3> scales(1);
  kvc::nvfp4_quantize(huge.data(), 16, top, codes.data(), scales.data());
  kvc::nvfp4_dequantize(codes.data(), scales.data(), 16, top, back.data());
  CHECK(back[0] == 2688.0f * 0x1p116f);  // saturated at the largest value, finite
}

TEST_CASE("NVFP4: a tensor scale that is not positive and finite is refused before anything is written") {
  std::vector<float> x(16, 1.0f);
  std::vector<std::uint8_t> codes(8, 0xAB);
  std::vector<kvc::float8_e4m3> scales(1, kvc::float8_e4m3::from_bits(0x11));
  std::vector<float> y(16, 7.0f);
  for (const auto& bad :
       std::vector<std::pair<float, std::string>>{{0.0f, "0"}, {-1.0f, "-1"}, {INFINITY, "inf"}, {NAN, "nan"}}) {
    const float g = bad.first;
    const std::string& text = bad.second;
    CAPTURE(text);
    const std::string tail = "the tensor scale must be positive and finite (at most 2^116), got " + text;
    const std::string quantize = "kvc::nvfp4_quantize: " + tail, dequantize = "kvc::nvfp4_dequantize: " + tail;
    CHECK_THROWS_WITH_AS(kvc::nvfp4_quantize(x.data(), 16, g, codes.data(), scales.data()), quantize.c_str(),
                         kvc::ValueError);
    CHECK_THROWS_WITH_AS(kvc::nvfp4_dequantize(codes.data(), scales.data(), 16, g, y.data()), dequantize.c_str(),
                         kvc::ValueError);
  }
  CHECK(codes == std::vector<std::uint8_t>(8, 0xAB));
  CHECK(scales[0].bits == 0x11);
  CHECK(y == std::vector<float>(16, 7.0f));
  CHECK_THROWS_WITH_AS(kvc::nvfp4_tensor_scale(0.0f),
                       "kvc::nvfp4_tensor_scale: amax must be positive and finite, got 0", kvc::ValueError);
}
