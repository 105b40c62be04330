// kvc::attend_quantized (attention straight from a quantized layer's codes) against kvc::attend
// (attention over what transformers' update returns): two caches of the same quantized layer kind
// fed the same steps, across several flushes of the residual. The outputs agree to rounding, the
// two layers hold the same codes, and the fused one keeps no dequantized workspace.

#include <cmath>
#include <optional>
#include <random>
#include <string>

#include <kvc/kvc.hpp>
#include <kvc/quantized_attention.hpp>

#include "../support/kvc_test.hpp"

namespace {

template <class T>
kvc::TensorView<T> view(const kvc::HostTensor<T>& t) {
  return kvc::HostStorage<T>::input_view(t);
}

template <class T>
double tolerance() {
  if constexpr (std::is_same_v<T, Eigen::half>) return 2e-3;
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return 1.6e-2;
  if constexpr (std::is_same_v<T, double>) return 1e-12;  // the same numbers, summed in another order
  return 1e-4;
}

// The workspace and code bytes of layer 0.
template <class Cache>
std::pair<std::int64_t, std::vector<std::uint8_t>> layer_state(const Cache& c) {
  return c.visit_layer(0, [](const auto& st) {
    std::vector<std::uint8_t> codes = st.quantized_keys().packed();
    const auto& v = st.quantized_values().packed();
    codes.insert(codes.end(), v.begin(), v.end());
    return std::pair{st.workspace_bytes(), codes};
  });
}

template <class T, class Kind>
void compare(const Kind& kind, std::optional<std::int64_t> window, unsigned seed) {
  using Cache = kvc::Cache<kvc::Replicate<Kind>, kvc::HostStorage<T>>;
  Cache exact(kind), fused(kind);
  std::mt19937 rng(seed);
  const std::int64_t B = 2, Hq = 4, Hkv = 2, D = 32;
  const std::vector<std::int64_t> steps = {20, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 9, 1, 1};
  double worst = 0;
  for (const std::int64_t q : steps) {
    const auto qs = kvc_test::random_tensor<T>(B, Hq, q, D, rng);
    const auto ks = kvc_test::random_tensor<T>(B, Hkv, q, D, rng);
    const auto vs = kvc_test::random_tensor<T>(B, Hkv, q, D, rng);
    const kvc::AttendOptions opts{.sliding_window = window};
    const auto want = kvc::attend(exact, 0, qs, ks, vs, opts);
    const auto got = kvc::attend_quantized(fused, 0, view(qs), view(ks), view(vs), opts);
    REQUIRE(got.dimension(2) == q);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t i = 0; i < q; ++i)
          for (std::int64_t d = 0; d < D; ++d)
            worst =
                std::max(worst, std::abs(static_cast<double>(got(b, h, i, d)) - static_cast<double>(want(b, h, i, d))));
    CHECK(fused.get_seq_length(0) == exact.get_seq_length(0));
    const auto [ws, codes] = layer_state(fused);
    CHECK(ws == 0);
    CHECK(codes == layer_state(exact).second);  // quantized at the same moments, to the same codes
  }
  CAPTURE(worst);
  CHECK(worst <= tolerance<T>());
  CHECK(fused.bytes() < exact.bytes());
}

}  // namespace

TEST_CASE("attend_quantized: the same attention as attend through update, from the codes, without a workspace") {
  const kvc::QuantoQuantizedLayer quanto{
      .nbits = 4, .axis_key = 0, .axis_value = 0, .q_group_size = 16, .residual_length = 6};
  const kvc::QuantoQuantizedLayer quanto_seq{
      .nbits = 2, .axis_key = -1, .axis_value = -1, .q_group_size = 8, .residual_length = 5};
  const kvc::HQQQuantizedLayer hqq{
      .nbits = 4, .axis_key = 1, .axis_value = 1, .q_group_size = 32, .residual_length = 7};
  for (unsigned seed : {1u, 2u}) {
    compare<float>(quanto, std::nullopt, seed);
    compare<float>(quanto_seq, std::nullopt, seed);
    compare<float>(hqq, std::nullopt, seed);
    compare<float>(quanto, 9, seed);  // the model's sliding window over a quantized history
    compare<Eigen::half>(quanto, std::nullopt, seed);
    compare<Eigen::bfloat16>(hqq, std::nullopt, seed);
    compare<double>(quanto_seq, 12, seed);
    compare<double>(hqq, std::nullopt, seed);
    compare<double>(quanto, 9, seed);
  }
}

TEST_CASE("attend_quantized: what it refuses, before anything is stored") {
  using Cache = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>>;
  Cache cache(kvc::QuantoQuantizedLayer{});
  std::mt19937 rng(3);
  const auto q = kvc_test::random_tensor<float>(1, 4, 2, 16, rng);
  const auto k = kvc_test::random_tensor<float>(1, 2, 2, 16, rng);
  const auto k3 = kvc_test::random_tensor<float>(1, 3, 2, 16, rng);
  (void)kvc::attend_quantized(cache, 0, view(q), view(k), view(k));
  const std::vector<std::uint8_t> mask(8, 1);
  CHECK_THROWS_WITH_AS(kvc::attend_quantized(cache, 0, view(q), view(k), view(k), {.key_padding_mask = mask}),
                       "kvc::attend_quantized: a key_padding_mask is not supported (use kvc::attend)", kvc::ValueError);
  const auto q3 = kvc_test::random_tensor<float>(1, 3, 2, 16, rng);
  CHECK_THROWS_WITH_AS(kvc::attend_quantized(cache, 0, view(q3), view(k), view(k)),
                       "kvc::attend_quantized: queries [1, 3, 2, 16], keys [1, 2, 2, 16] and values [1, 2, 2, 16] do "
                       "not fit each other or the layer (head_dim at most 256)",
                       kvc::ValueError);
  // Keys the layer cannot hold: the cache's update message.
  CHECK_THROWS_WITH_AS(kvc::attend_quantized(cache, 0, view(q), view(k3), view(k3)),
                       "update: keys of shape [1, 3, 2, 16] and values of shape [1, 3, 2, 16] do not match layer 0, "
                       "which holds batch 1, 2 heads, key head_dim 16 and value head_dim 16",
                       kvc::ValueError);
  CHECK(cache.get_seq_length(0) == 2);

  kvc::DynamicCache<float> dynamic;
  (void)kvc::attend(dynamic, 0, q, k, k);
  CHECK_THROWS_WITH_AS(kvc::attend_quantized(dynamic, 0, view(q), view(k), view(k)),
                       "kvc::attend_quantized: layer 0 is a DynamicLayer, not a quantized layer", kvc::ValueError);
}

TEST_CASE(
    "attend_quantized's store: int4 under 0.30 and int2 under 0.17 of fp16 bytes at 4096 tokens (update: over 1)") {
  using H = Eigen::half;
  using Cache = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<H>>;
  std::mt19937 rng(5);
  const auto prefill = kvc_test::random_tensor<H>(1, 8, 4032, 128, rng);
  const auto tok = kvc_test::random_tensor<H>(1, 8, 1, 128, rng);
  const double fp16 = 4096.0 * 2 * 8 * 128 * 2;  // K and V of 4096 tokens, 2 bytes each
  const auto held = [&](std::int64_t nbits, bool fused) {
    Cache cache(kvc::QuantoQuantizedLayer{
        .nbits = nbits, .axis_key = 0, .axis_value = 0, .q_group_size = 64, .residual_length = 128});
    const auto store = [&](const kvc::HostTensor<H>& x) {
      if (fused)
        cache.update_with(view(x), view(x), 0, [&](auto& st) {
          st.append(view(x), view(x));
          return 0;
        });
      else
        (void)cache.update(x, x, 0);
    };
    store(prefill);
    for (int i = 0; i < 64; ++i) store(tok);
    CHECK(cache.get_seq_length(0) == 4096);
    return static_cast<double>(cache.bytes()) / fp16;
  };
  const double int4 = held(4, true), int2 = held(2, true), int4_update = held(4, false);
  CAPTURE(int4);
  CAPTURE(int2);
  CAPTURE(int4_update);
  CHECK(int4 <= 0.30);
  CHECK(int2 <= 0.17);
  CHECK(int4_update > 1.0);  // the workspace: a dequantized copy of every token
}
