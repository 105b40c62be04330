// fp8 KV (<kvc/fp8_attention.hpp>): caches whose element type is kvc::float8_e4m3 or float8_e5m2,
// written by kvc::to_fp8 / kvc::attend_fp8 with per-tensor or per-head scales. The codes are the
// OFP8 conversions of x / scale; attention over them equals attention in double over the values the
// codes stand for (scale * code) to float rounding, for dynamic, sliding and static layers; the
// bytes held are half of fp16's.

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <kvc/fp8_attention.hpp>
#include <kvc/kvc.hpp>

#include "../support/kvc_test.hpp"

namespace {

template <class T>
kvc::TensorView<T> view(const kvc::HostTensor<T>& t) {
  return kvc::HostStorage<T>::input_view(t);
}

kvc::HostTensor<float> gaussian(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, std::mt19937& rng,
                                float sigma) {
  std::normal_distribution<float> dist(0.f, sigma);
  kvc::HostTensor<float> t(b, h, s, d);
  for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = dist(rng) * (1.f + static_cast<float>(i / (s * d) % 2));
  return t;
}

// What codes stand for: scale(head) * value(code), in double.
template <class F8>
kvc::HostTensor<double> dequantized(const kvc::HostTensor<F8>& c, std::span<const float> scales) {
  kvc::HostTensor<double> out(c.dimension(0), c.dimension(1), c.dimension(2), c.dimension(3));
  for (std::int64_t b = 0; b < c.dimension(0); ++b)
    for (std::int64_t h = 0; h < c.dimension(1); ++h)
      for (std::int64_t s = 0; s < c.dimension(2); ++s)
        for (std::int64_t d = 0; d < c.dimension(3); ++d)
          out(b, h, s, d) = static_cast<double>(scales[scales.size() == 1 ? 0 : static_cast<std::size_t>(h)]) *
                            static_cast<double>(c(b, h, s, d).to_float());
  return out;
}

kvc::ModelConfig config(std::int64_t layers) {
  kvc::ModelConfig c;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.hidden_size = 64;
  c.sliding_window = 6;
  c.layer_types = std::vector<std::string>{"sliding_attention", "full_attention"};
  return c;
}

// x with each row of its last extent rotated (kvc::hadamard_rotate; a second call rotates back).
template <class T>
kvc::HostTensor<T> rotated(kvc::HostTensor<T> x) {
  const std::int64_t d = x.dimension(3);
  kvc::hadamard_rotate(x.data(), x.size() / d, d);
  return x;
}

// attend_fp8 through `cache` against kvc::attend in double through a DynamicCache<double> fed the
// dequantized codes (rotated back where scales.rotation says), over prefills, decode steps and a
// multi-token step, on every layer.
template <class F8, class Cache>
void check_against_double(Cache& cache, const kvc::Fp8Scales& scales, unsigned seed) {
  kvc::DynamicCache<double> ref;
  std::mt19937 rng(seed);
  const std::int64_t layers = cache.size();
  double worst = 0;
  for (const std::int64_t q : {9, 1, 1, 3, 1, 1, 1, 1, 2}) {
    for (std::int64_t layer = 0; layer < layers; ++layer) {
      const auto qs = gaussian(1, 4, q, 16, rng, 1.f), ks = gaussian(1, 2, q, 16, rng, 3.f),
                 vs = gaussian(1, 2, q, 16, rng, 0.5f);
      const auto got =
          kvc::attend_fp8(cache, layer, view(qs), view(ks), view(vs), scales,
                          {.sliding_window = layer % 2 == 0 ? std::optional<std::int64_t>(6) : std::nullopt});
      // The reference: the same codes, as doubles.
      const auto k8 = kvc::to_fp8<F8>(view(ks), scales.keys, scales.rotation.keys),
                 v8 = kvc::to_fp8<F8>(view(vs), scales.values, scales.rotation.values);
      kvc::HostTensor<double> qd = qs.template cast<double>(), kd = dequantized(k8, scales.keys),
                              vd = dequantized(v8, scales.values);
      if (scales.rotation.keys) kd = rotated(std::move(kd));
      if (scales.rotation.values) vd = rotated(std::move(vd));
      const auto want = kvc::attend(ref, layer, qd, kd, vd,
                                    {.sliding_window = layer % 2 == 0 ? std::optional<std::int64_t>(6) : std::nullopt});
      for (std::int64_t i = 0; i < got.size(); ++i)
        worst = std::max(
            worst, std::abs(static_cast<double>(got.data()[i]) - want.data()[i]) / (1.0 + std::abs(want.data()[i])));
      CHECK(cache.get_seq_length(layer) == ref.get_seq_length(layer));
    }
  }
  CAPTURE(worst);
  // Rotation adds float's rounding of the rotated queries and output (sums of 16 values).
  CHECK(worst < (scales.rotation.keys || scales.rotation.values ? 1e-5 : 2e-6));
}

}  // namespace

TEST_CASE("to_fp8: the OFP8 code of x / scale, per tensor and per head, saturating") {
  std::mt19937 rng(1);
  const auto x = gaussian(2, 3, 5, 8, rng, 100.f);
  const std::vector<float> per_tensor{0.5f}, per_head{0.25f, 2.f, 0.125f};
  for (const auto& scales : {per_tensor, per_head}) {
    const auto c = kvc::to_fp8<kvc::float8_e4m3>(view(x), scales);
    const auto c5 = kvc::to_fp8<kvc::float8_e5m2>(view(x), scales);
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 3; ++h)
        for (std::int64_t s = 0; s < 5; ++s)
          for (std::int64_t d = 0; d < 8; ++d) {
            const float scaled = x(b, h, s, d) / scales[scales.size() == 1 ? 0 : static_cast<std::size_t>(h)];
            CHECK(c(b, h, s, d).bits == kvc::float8_e4m3(scaled).bits);
            CHECK(c5(b, h, s, d).bits == kvc::float8_e5m2(scaled).bits);
          }
  }
  // Saturation: far beyond 448 * scale is the largest finite code of its sign.
  kvc::HostTensor<float> big(1, 1, 1, 2);
  big(0, 0, 0, 0) = 1e6f;
  big(0, 0, 0, 1) = -1e6f;
  const auto sat = kvc::to_fp8<kvc::float8_e4m3>(view(big), std::vector<float>{1.f});
  CHECK(sat(0, 0, 0, 0).to_float() == 448.f);
  CHECK(sat(0, 0, 0, 1).to_float() == -448.f);
}

TEST_CASE("to_fp8 and fp8_scales_for with rotation: the codes and scales of the rotated rows") {
  // head_dim 16 (one block of 16) and 12 (three blocks of 4); an outlier channel in every row.
  std::mt19937 rng(6);
  for (const std::int64_t d : {16, 12}) {
    CAPTURE(d);
    auto x = gaussian(2, 3, 5, d, rng, 1.f), y = gaussian(2, 3, 5, d, rng, 2.f);
    for (std::int64_t i = 0; i < x.size(); i += d) x.data()[i + 1] *= 50.f;
    const std::vector<float> per_head{0.25f, 2.f, 0.125f};
    const auto by_hand = kvc::to_fp8<kvc::float8_e4m3>(view(rotated(x)), per_head);
    const auto rot = kvc::to_fp8<kvc::float8_e4m3>(view(x), per_head, true);
    const auto plain = kvc::to_fp8<kvc::float8_e4m3>(view(x), per_head);
    int differ = 0;
    for (std::int64_t i = 0; i < x.size(); ++i) {
      CHECK(rot.data()[i].bits == by_hand.data()[i].bits);
      differ += rot.data()[i].bits != plain.data()[i].bits;
    }
    CHECK(differ > x.size() / 2);
    // to_fp8_keys / to_fp8_values: each side's list and rotation from one Fp8Scales.
    const kvc::Fp8Scales sides{per_head, {0.5f}, {.keys = true}};
    const auto keys = kvc::to_fp8_keys<kvc::float8_e4m3>(view(x), sides),
               values = kvc::to_fp8_values<kvc::float8_e4m3>(view(x), sides),
               values_by_hand = kvc::to_fp8<kvc::float8_e4m3>(view(x), std::vector<float>{0.5f});
    for (std::int64_t i = 0; i < x.size(); ++i) {
      CHECK(keys.data()[i].bits == rot.data()[i].bits);
      CHECK(values.data()[i].bits == values_by_hand.data()[i].bits);
    }
    for (const auto granularity : {kvc::Fp8ScaleGranularity::per_tensor, kvc::Fp8ScaleGranularity::per_head}) {
      const kvc::Fp8Rotation keys_only{.keys = true};
      const auto s = kvc::fp8_scales_for<kvc::float8_e4m3>(view(x), view(y), granularity, keys_only);
      const auto want = kvc::fp8_scales_for<kvc::float8_e4m3>(view(rotated(x)), view(y), granularity);
      CHECK(s.keys == want.keys);
      CHECK(s.values == want.values);
      CHECK((s.rotation.keys && !s.rotation.values));
      // The outlier spread over its block of b values (about 1 / sqrt(b) of it in each): the
      // rotated keys need a smaller scale.
      const auto unrotated = kvc::fp8_scales_for<kvc::float8_e4m3>(view(x), view(y), granularity);
      CHECK(s.keys[0] < 1.5f / std::sqrt(static_cast<float>(kvc::hadamard_block(d))) * unrotated.keys[0]);
    }
  }
}

TEST_CASE("fp8_scales_for: the largest magnitude per tensor or per head maps to the format's largest value") {
  kvc::HostTensor<float> k(1, 2, 3, 2), v(1, 2, 3, 2);
  k.setZero();
  v.setZero();
  k(0, 0, 1, 1) = -8.96f;
  k(0, 1, 2, 0) = 4.48f;
  v(0, 1, 0, 0) = 57344.f;
  const auto head = kvc::fp8_scales_for<kvc::float8_e4m3>(view(k), view(v), kvc::Fp8ScaleGranularity::per_head);
  CHECK(head.keys == std::vector<float>{8.96f / 448.f, 4.48f / 448.f});
  CHECK(head.values == std::vector<float>{1.f, 57344.f / 448.f});  // an all-zero head keeps 1
  const auto tensor = kvc::fp8_scales_for<kvc::float8_e5m2>(view(k), view(v), kvc::Fp8ScaleGranularity::per_tensor);
  CHECK(tensor.keys == std::vector<float>{8.96f / 57344.f});
  CHECK(tensor.values == std::vector<float>{1.f});
}

TEST_CASE_TEMPLATE("attend_fp8 equals attention in double over the codes' values: dynamic, sliding, static", F8,
                   kvc::float8_e4m3, kvc::float8_e5m2) {
  const kvc::Fp8Scales per_tensor{{0.02f}, {0.004f}};
  const kvc::Fp8Scales per_head{{0.01f, 0.03f}, {0.002f, 0.005f}};
  // Rotated keys and values (Fp8Scales::rotation): the queries rotated as the keys, the output back.
  const kvc::Fp8Scales rotated_keys{{0.02f}, {0.004f}, {.keys = true}};
  const kvc::Fp8Scales rotated_both{{0.01f, 0.03f}, {0.002f, 0.005f}, {.keys = true, .values = true}};
  for (const auto* scales : {&per_tensor, &per_head, &rotated_keys, &rotated_both}) {
    kvc::DynamicCache<F8> dynamic;
    check_against_double<F8>(dynamic, *scales, 3);
    auto sliding = kvc::make_dynamic_cache<F8>(config(2));  // a DynamicSlidingWindowLayer, a DynamicLayer
    check_against_double<F8>(sliding, *scales, 4);
    kvc::StaticCache<F8> fixed(config(2), 32);  // a StaticSlidingWindowLayer, a StaticLayer
    check_against_double<F8>(fixed, *scales, 5);
    CHECK(std::string(fixed.layer_name(0)) == "StaticSlidingWindowLayer");
  }
}

TEST_CASE("fp8 KV holds half of fp16's bytes: a static cache and a dynamic one at 4096 tokens") {
  const double fp16 = 4096.0 * 2 * 8 * 128 * 2;  // K and V of 4096 tokens, 8 heads of 128, 2 bytes each
  kvc::ModelConfig c;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.hidden_size = 4096;
  kvc::StaticCache<kvc::float8_e4m3> fixed(c, 4096);
  std::mt19937 rng(7);
  const auto x = gaussian(1, 8, 4096, 128, rng, 1.f);
  const auto q = gaussian(1, 32, 1, 128, rng, 1.f);
  kvc::DynamicCache<kvc::float8_e4m3> dynamic;  // stored as attend_fp8 stores (no 4096-query prefill)
  const auto codes = kvc::to_fp8<kvc::float8_e4m3>(view(x), std::vector<float>{1.f});
  (void)dynamic.update(codes, codes, 0);
  const auto one = gaussian(1, 8, 1, 128, rng, 1.f);
  (void)kvc::attend_fp8(fixed, 0, view(q), view(one), view(one), {});
  const double static_fraction = static_cast<double>(fixed.bytes()) / fp16;
  const double dynamic_fraction = static_cast<double>(dynamic.bytes()) / fp16;
  CAPTURE(static_fraction);
  CAPTURE(dynamic_fraction);
  CHECK(static_fraction == 0.5);  // one byte per element, nothing else
  CHECK(dynamic_fraction <= 0.52);
}

TEST_CASE("attend_fp8 with rotation: bfloat16 models, and what a device refuses") {
  // The queries are rotated in float and the output rotated back in float, rounded to T once: as
  // close to attention in double over the held values as the unrotated call is.
  std::mt19937 rng(8);
  const kvc::Fp8Scales plain{{0.01f, 0.03f}, {0.002f, 0.005f}};
  const kvc::Fp8Scales rot{plain.keys, plain.values, {.keys = true, .values = true}};
  for (const auto* scales : {&plain, &rot}) {
    kvc::DynamicCache<kvc::float8_e4m3> c16, c32;
    double worst = 0;
    for (const std::int64_t q : {7, 1, 2}) {
      const auto qs = gaussian(1, 4, q, 16, rng, 1.f), ks = gaussian(1, 2, q, 16, rng, 3.f),
                 vs = gaussian(1, 2, q, 16, rng, 0.5f);
      const kvc::HostTensor<Eigen::bfloat16> qb = qs.cast<Eigen::bfloat16>(), kb = ks.cast<Eigen::bfloat16>(),
                                             vb = vs.cast<Eigen::bfloat16>();
      const kvc::HostTensor<float> qf = qb.cast<float>(), kf = kb.cast<float>(), vf = vb.cast<float>();
      const auto got = kvc::attend_fp8(c16, 0, qb, kb, vb, *scales);
      const auto want = kvc::attend_fp8(c32, 0, qf, kf, vf, *scales);  // the same inputs, in float
      for (std::int64_t i = 0; i < got.size(); ++i)
        worst = std::max(worst, std::abs(static_cast<double>(static_cast<float>(got.data()[i])) - want.data()[i]) /
                                    (std::abs(want.data()[i]) + 1e-3));
    }
    CAPTURE(worst);
    CHECK(worst <= 1.0 / 256);  // half a bfloat16 ulp, plus float's rounding
  }
  CHECK_THROWS_WITH_AS(kvc::detail::check_fp8_unrotated(rot.rotation, "kvc::paged_attention"),
                       "kvc::paged_attention: fp8 codes of rotated rows (Fp8Scales::rotation) are read on the host "
                       "only; encode them unrotated for the device",
                       kvc::ValueError);
  CHECK_NOTHROW(kvc::detail::check_fp8_unrotated(plain.rotation, "kvc::paged_attention"));
}

TEST_CASE("attend_fp8 refuses bad scales before the cache changes") {
  kvc::DynamicCache<kvc::float8_e4m3> cache;
  std::mt19937 rng(9);
  const auto q = gaussian(1, 4, 2, 16, rng, 1.f), k = gaussian(1, 2, 2, 16, rng, 1.f);
  (void)kvc::attend_fp8(cache, 0, view(q), view(k), view(k), {});
  const auto snapshot = kvc_test::take_snapshot(cache);
  CHECK_THROWS_WITH_AS(kvc::attend_fp8(cache, 0, view(q), view(k), view(k), {{1.f, 1.f, 1.f}, {1.f}}),
                       "kvc fp8: key scales: 3 given; one per tensor or one per KV head (2) expected", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::attend_fp8(cache, 0, view(q), view(k), view(k), {{1.f}, {0.f}}),
                       "kvc fp8: value scales must be positive and finite, got 0.000000", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::to_fp8<kvc::float8_e5m2>(view(k), std::vector<float>{-1.f}),
                       "kvc fp8: the scales must be positive and finite, got -1.000000", kvc::ValueError);
  CHECK(kvc_test::take_snapshot(cache) == snapshot);
  CHECK(cache.get_seq_length() == 2);
}

TEST_CASE("attend_fp8 refuses scales whose reciprocal overflows, per tensor and per head, before the cache changes") {
  // 1e-40 and 1.4e-45 (the smallest denormal) are positive and finite, but 1 / scale is infinite:
  // a zero would encode as 0 * inf, NaN.
  kvc::DynamicCache<kvc::float8_e4m3> cache;
  std::mt19937 rng(17);
  const auto q = gaussian(1, 4, 2, 16, rng, 1.f), k = gaussian(1, 2, 2, 16, rng, 1.f);
  (void)kvc::attend_fp8(cache, 0, view(q), view(k), view(k), {});
  const auto snapshot = kvc_test::take_snapshot(cache);
  // (No structured binding: clang 14's CAPTURE, a lambda, cannot capture one.)
  for (const auto& tiny_printed :
       {std::pair{1e-40f, std::string("1e-40")}, std::pair{1.4e-45f, std::string("1e-45")}}) {
    const float tiny = tiny_printed.first;
    const std::string& printed = tiny_printed.second;
    CAPTURE(printed);
    const std::string key = "kvc fp8: key scales must have a finite reciprocal, got " + printed;
    const std::string value = "kvc fp8: value scales must have a finite reciprocal, got " + printed;
    CHECK_THROWS_WITH_AS(kvc::attend_fp8(cache, 0, view(q), view(k), view(k), {{tiny}, {1.f}}), key.c_str(),
                         kvc::ValueError);
    CHECK_THROWS_WITH_AS(kvc::attend_fp8(cache, 0, view(q), view(k), view(k), {{1.f}, {tiny}}), value.c_str(),
                         kvc::ValueError);
    CHECK_THROWS_WITH_AS(kvc::attend_fp8(cache, 0, view(q), view(k), view(k), {{1.f, tiny}, {1.f, 1.f}}), key.c_str(),
                         kvc::ValueError);
    CHECK_THROWS_WITH_AS(kvc::attend_fp8(cache, 0, view(q), view(k), view(k), {{1.f, 1.f}, {tiny, 1.f}}), value.c_str(),
                         kvc::ValueError);
    CHECK(kvc_test::take_snapshot(cache) == snapshot);
    const std::string the = "kvc fp8: the scales must have a finite reciprocal, got " + printed;
    CHECK_THROWS_WITH_AS(kvc::to_fp8<kvc::float8_e5m2>(view(k), std::vector<float>{tiny}), the.c_str(),
                         kvc::ValueError);
    CHECK_THROWS_WITH_AS(kvc::to_fp8<kvc::float8_e4m3>(view(k), std::vector<float>{2.f, tiny}), the.c_str(),
                         kvc::ValueError);
  }
  CHECK(kvc_test::take_snapshot(cache) == snapshot);
  CHECK(cache.get_seq_length() == 2);
  // A denormal scale whose reciprocal is finite is still taken: zero encodes as zero.
  kvc::HostTensor<float> zeros(1, 2, 2, 16);
  zeros.setZero();
  const auto codes = kvc::to_fp8<kvc::float8_e4m3>(view(zeros), std::vector<float>{1e-38f});
  for (std::int64_t i = 0; i < codes.size(); ++i) CHECK(codes.data()[i].to_float() == 0.f);
}

TEST_CASE("attend_fp8: a step of no query tokens gives an empty output, as kvc::attend does") {
  kvc::DynamicCache<kvc::float8_e4m3> cache;
  std::mt19937 rng(19);
  const auto q = gaussian(1, 4, 3, 16, rng, 1.f), k = gaussian(1, 2, 3, 16, rng, 1.f);
  const auto q0 = gaussian(1, 4, 0, 16, rng, 1.f), k0 = gaussian(1, 2, 0, 16, rng, 1.f);
  const kvc::Fp8Scales per_head{{0.5f, 2.f}, {1.f, 0.25f}};
  for (int step = 0; step < 2; ++step) {  // on an empty layer, then on one that holds tokens
    const auto out = kvc::attend_fp8(cache, 0, view(q0), view(k0), view(k0), per_head);
    CHECK(out.dimension(0) == 1);
    CHECK(out.dimension(1) == 4);
    CHECK(out.dimension(2) == 0);
    CHECK(out.dimension(3) == 16);
    CHECK(cache.get_seq_length() == 3 * step);
    (void)kvc::attend_fp8(cache, 0, view(q), view(k), view(k), per_head);
  }
}

TEST_CASE("fp8 reconstruction error on gaussian K/V with per-head scales (the formats table's figures)") {
  std::mt19937 rng(13);
  const auto x = gaussian(1, 8, 1024, 128, rng, 1.f);
  const auto rel_rms = [&](auto tag) {
    using F8 = decltype(tag);
    const auto s = kvc::fp8_scales_for<F8>(view(x), view(x), kvc::Fp8ScaleGranularity::per_head);
    const auto back = dequantized(kvc::to_fp8<F8>(view(x), s.keys), s.keys);
    double num = 0, den = 0;
    for (std::int64_t i = 0; i < x.size(); ++i) {
      num += (back.data()[i] - x.data()[i]) * (back.data()[i] - x.data()[i]);
      den += static_cast<double>(x.data()[i]) * x.data()[i];
    }
    return std::sqrt(num / den);
  };
  const double e4m3 = rel_rms(kvc::float8_e4m3{}), e5m2 = rel_rms(kvc::float8_e5m2{});
  MESSAGE("relative RMS error: E4M3 " << e4m3 << ", E5M2 " << e5m2);
  // Half an ulp is at most 2^-4 of the value with 3 mantissa bits (E4M3), 2^-3 with 2 (E5M2); the
  // RMS of a rounding spread evenly over half an ulp is about 0.6 of that at its largest, less on
  // average over a binade: 0.026 and 0.053 measured.
  CHECK(e4m3 < 0.03);
  CHECK(e5m2 < 0.06);
  CHECK(e4m3 < e5m2);
}
