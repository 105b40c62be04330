// kvc::float8_e4m3 and kvc::float8_e5m2 against the OCP 8-bit Floating Point Specification (OFP8
// rev. 1.0): the spec's table values, every one of the 256 codes of each format decoded, and
// float -> code checked against a brute-force encoder (the nearest representable value, ties to
// the even code, overflow past the largest finite value) on every code's value, every midpoint
// between neighbours and just either side of it, random floats over the whole range, and a sweep
// over the float bit patterns.

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <kvc/detail/element_conversion.hpp>
#include <kvc/float8.hpp>

#include "../support/float_inputs.hpp"
#include "../support/kvc_test.hpp"

namespace {

// The value of a code from the spec's formula, in double by another route than the library's.
template <class F>
double spec_value(std::uint8_t code) {
  using fmt = typename F::format;
  const int s = code >> 7, e = (code >> fmt::mantissa_bits) & ((1 << fmt::exponent_bits) - 1),
            m = code & fmt::mantissa_mask;
  const double frac = static_cast<double>(m) / static_cast<double>(1 << fmt::mantissa_bits);
  const double v = e == 0 ? frac * std::pow(2.0, 1 - fmt::bias) : (1.0 + frac) * std::pow(2.0, e - fmt::bias);
  return s ? -v : v;
}

// The brute-force encoder: the nearest of the non-negative finite codes and a virtual code one past
// the largest (its value one step above it), ties to the even code; the virtual code is overflow.
template <class F>
std::uint8_t reference_encode(float x, kvc::fp8_overflow mode) {
  using fmt = typename F::format;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return static_cast<std::uint8_t>(sign | 0x7F);
  const auto overflow = static_cast<std::uint8_t>(
      sign | (mode == kvc::fp8_overflow::saturate ? fmt::max_finite : (fmt::has_infinity ? fmt::infinity : 0x7F)));
  if (std::isinf(x)) return overflow;
  const double a = std::fabs(static_cast<double>(x));
  const int virtual_code = fmt::max_finite + 1;
  const double virtual_value = 2 * spec_value<F>(fmt::max_finite) - spec_value<F>(fmt::max_finite - 1);
  if (a >= virtual_value) return overflow;  // (far above it, the distances below would round equal)
  int best = -1;
  double best_d = 0;
  for (int c = 0; c <= virtual_code; ++c) {
    const double v = c == virtual_code ? virtual_value : spec_value<F>(static_cast<std::uint8_t>(c));
    const double d = std::fabs(a - v);
    if (best < 0 || d < best_d || (d == best_d && c % 2 == 0)) {
      best = c;
      best_d = d;
    }
  }
  if (best == virtual_code) return overflow;
  return static_cast<std::uint8_t>(sign | best);
}

template <class F>
void check_encoding(float x) {
  for (const auto mode : {kvc::fp8_overflow::saturate, kvc::fp8_overflow::non_saturating}) {
    const std::uint8_t got = F(x, mode).bits, want = reference_encode<F>(x, mode);
    if (got != want)
      FAIL("encode(" << x << std::string(mode == kvc::fp8_overflow::saturate ? ", saturate" : ", non-saturating")
                     << ") gave code " << int{got} << ", expected " << int{want});
  }
}

template <class F>
void check_format(unsigned seed) {
  using fmt = typename F::format;
  // Every code decodes to the spec's value (NaN codes to NaN, E5M2's infinity codes to infinity).
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const float v = F::from_bits(code).to_float();
    CAPTURE(c);
    if (fmt::is_nan(code)) {
      CHECK(std::isnan(v));
      ++nans;
    } else if (fmt::has_infinity && (code & 0x7F) == fmt::infinity) {
      CHECK(std::isinf(v));
      CHECK(std::signbit(v) == (c >= 128));
    } else {
      CHECK(static_cast<double>(v) == spec_value<F>(code));
      CHECK(std::signbit(v) == (c >= 128));
    }
  }
  CHECK(nans == (fmt::has_infinity ? 6 : 2));
  // The positive finite codes are the values in increasing order.
  for (int c = 1; c <= fmt::max_finite; ++c)
    CHECK(F::from_bits(static_cast<std::uint8_t>(c)).to_float() >
          F::from_bits(static_cast<std::uint8_t>(c - 1)).to_float());

  // Encoding: every code's value, both signs, and every midpoint and its neighbours.
  std::vector<float> inputs;
  for (int c = 0; c < 256; ++c) inputs.push_back(F::from_bits(static_cast<std::uint8_t>(c)).to_float());
  std::vector<double> values;
  for (int c = 0; c <= fmt::max_finite; ++c) values.push_back(spec_value<F>(static_cast<std::uint8_t>(c)));
  values.push_back(2 * values.back() - values[values.size() - 2]);
  kvc_test::push_midpoints(inputs, values);
  kvc_test::push_special_floats(inputs);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-2 - fmt::bias - fmt::mantissa_bits, fmt::bias + 3);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::ldexp(mantissa(rng), exponent(rng));
    inputs.push_back(i % 2 ? -x : x);
  }
  for (const float x : inputs) check_encoding<F>(x);
}

}  // namespace

TEST_CASE("float8 E4M3: the spec's values, all 256 codes, and rounding against a brute-force encoder") {
  using F = kvc::float8_e4m3;
  CHECK(F(1.0f).bits == 0x38);
  CHECK(F::from_bits(0x7E).to_float() == 448.0f);                // the largest finite value
  CHECK(F::from_bits(0x08).to_float() == std::ldexp(1.0f, -6));  // smallest normal
  CHECK(F::from_bits(0x07).to_float() == std::ldexp(7.0f, -9));  // largest subnormal
  CHECK(F::from_bits(0x01).to_float() == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(std::signbit(F::from_bits(0x80).to_float()));
  CHECK(F::from_bits(0x7F).is_nan());
  CHECK(F::from_bits(0xFF).is_nan());
  CHECK_FALSE(F::from_bits(0x78).is_nan());  // S.1111.000 = 256: E4M3 has no infinity
  // Rounding at the top: 464 is halfway between 448 (mantissa 110, even) and 480 (no such value).
  CHECK(F(464.0f).bits == 0x7E);
  CHECK(F(465.0f).bits == 0x7E);  // saturates
  CHECK(F(465.0f, kvc::fp8_overflow::non_saturating).bits == 0x7F);
  CHECK(F(-1e30f, kvc::fp8_overflow::non_saturating).bits == 0xFF);
  CHECK(F(-std::numeric_limits<float>::infinity()).bits == 0xFE);
  CHECK(F(std::ldexp(1.0f, -10)).bits == 0x00);  // half the smallest subnormal: to even, 0
  CHECK(F(std::ldexp(3.0f, -11)).bits == 0x01);  // three quarters of it: up
  check_format<F>(1);
}

TEST_CASE("float8 E5M2: the spec's values, all 256 codes, and rounding against a brute-force encoder") {
  using F = kvc::float8_e5m2;
  CHECK(F(1.0f).bits == 0x3C);
  CHECK(F::from_bits(0x7B).to_float() == 57344.0f);
  CHECK(F::from_bits(0x04).to_float() == std::ldexp(1.0f, -14));
  CHECK(F::from_bits(0x01).to_float() == std::ldexp(1.0f, -16));
  CHECK(std::isinf(F::from_bits(0x7C).to_float()));
  CHECK(F::from_bits(0x7D).is_nan());
  CHECK(F::from_bits(0xFE).is_nan());
  // 61440 is halfway between 57344 (mantissa 11, odd) and 65536 (the next binade): it overflows.
  CHECK(F(61440.0f).bits == 0x7B);
  CHECK(F(61440.0f, kvc::fp8_overflow::non_saturating).bits == 0x7C);
  CHECK(F(61439.0f, kvc::fp8_overflow::non_saturating).bits == 0x7B);
  CHECK(F(std::numeric_limits<float>::infinity(), kvc::fp8_overflow::non_saturating).bits == 0x7C);
  CHECK(F(-std::numeric_limits<float>::quiet_NaN()).bits == 0xFF);
  check_format<F>(2);
}

TEST_CASE_TEMPLATE(
    "widen (attention's conversion of stored codes) gives to_float bit for bit for all 256 codes, at any offset", F8,
    kvc::float8_e4m3, kvc::float8_e5m2) {
  std::vector<F8> codes;
  for (int rep = 0; rep < 2; ++rep)
    for (int c = 0; c < 256; ++c) codes.push_back(F8::from_bits(static_cast<std::uint8_t>((c * 37 + rep) & 0xFF)));
  // Every form: AVX2 where the CPU has it, then SSE2 (and the scalar tail) with AVX2 off.
  const bool had_avx2 = kvc::detail::avx2_enabled();
  for (const bool avx2 : {true, false})
    for (const std::int64_t offset : {0, 1, 3}) {
      if (avx2 && !had_avx2) continue;
      kvc::detail::avx2_enabled() = avx2;
      CAPTURE(avx2);
      const auto n = static_cast<std::int64_t>(codes.size()) - offset;
      std::vector<float> out(static_cast<std::size_t>(n), -1.0f);
      F8::widen(codes.data() + offset, out.data(), n);
      for (std::int64_t i = 0; i < n; ++i) {
        const F8 code = codes[static_cast<std::size_t>(offset + i)];
        const float want = code.to_float(), got = out[static_cast<std::size_t>(i)];
        CAPTURE(static_cast<int>(code.bits));
        // Bit for bit: -0, and every NaN code as the quiet NaN of its sign, included.
        CHECK(std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want));
      }
    }
  kvc::detail::avx2_enabled() = had_avx2;
}

TEST_CASE_TEMPLATE("the element conversions: fp8 through detail::to_float and from_float, the decode reference", F8,
                   kvc::float8_e4m3, kvc::float8_e5m2) {
  for (int c = 0; c < 256; ++c) {
    CAPTURE(c);
    const F8 x = F8::from_bits(static_cast<std::uint8_t>(c));
    const float f = kvc::detail::to_float(x);
    const auto bits = std::bit_cast<std::uint32_t>(f);
    CHECK(bits == std::bit_cast<std::uint32_t>(x.to_float()));
    if (std::isnan(f)) {
      CHECK((bits & 0x7FFFFFFFu) == 0x7FC00000u);  // the quiet NaN, with the code's sign
      CHECK(std::signbit(f) == ((c & 0x80) != 0));
    } else if (!std::isinf(f)) {
      CHECK(kvc::detail::from_float<F8>(f).bits == c);  // every finite code back to itself, -0 included
    }
  }
  // The other element types: static_cast, round to nearest even.
  CHECK(kvc::detail::to_float(Eigen::half(0.1f)) == static_cast<float>(Eigen::half(0.1f)));
  CHECK(kvc::detail::from_float<Eigen::bfloat16>(1.00390625f) == Eigen::bfloat16(1.0f));  // a tie, to even
  CHECK(kvc::detail::from_float<double>(0.1f) == static_cast<double>(0.1f));
}
