// transformers' CacheCroppingTests (tests/utils/test_cache_utils.py): every dynamic layer kind
// (attention, sliding, linear, both dynamic hybrids, indexed) recorded for 45 tokens, then cropped:
// sliding_window 12, conv kernel 4, attention [2, 32, 45, 32], conv [2, 32, 45], indexer [2, 45, 32].
#include <random>
#include <string>
#include <vector>

#include "../support/kvc_test.hpp"

namespace {

constexpr std::int64_t window = 12, seq_len = 45, kernel = 4;

using Kinds = kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer, kvc::LinearAttentionLayer,
                          kvc::LinearAttentionAndFullAttentionLayer, kvc::LinearAttentionAndSlidingWindowAttentionLayer,
                          kvc::DynamicIndexedLayer>;
using C = kvc::Cache<Kinds>;
using Conv = Eigen::Tensor<float, 3, Eigen::RowMajor>;

struct Inputs {
  kvc::HostTensor<float> keys, values;
  Conv conv, indexer;
};

Inputs make_inputs() {
  std::mt19937 rng(43);
  Inputs in{kvc_test::random_tensor<float>(2, 32, seq_len, 32, rng),
            kvc_test::random_tensor<float>(2, 32, seq_len, 32, rng), Conv(2, 32, seq_len), Conv(2, seq_len, 32)};
  std::uniform_real_distribution<float> u(-1, 1);
  for (std::int64_t i = 0; i < in.conv.size(); ++i) in.conv.data()[i] = u(rng);
  for (std::int64_t i = 0; i < in.indexer.size(); ++i) in.indexer.data()[i] = u(rng);
  return in;
}

// The cache of one layer of kind `kind`, recorded and filled as the transformers test does.
template <class Kind>
C filled(const Kind& kind, const Inputs& in, bool record = true) {
  C cache(std::vector<C::kind_variant>{kind});
  if (record) cache.activate_past_recording();
  const bool has_kv = !cache.is_linear()[0];
  if (has_kv) cache.update(in.keys, in.values, 0);
  const bool has_conv = cache.visit_layer(0, [](const auto& l) { return requires { l.number_of_states(); }; });
  if (has_conv) cache.update_conv_state(in.conv, 0, 0, kernel);
  const bool has_indexer = std::string(cache.layer_name(0)).find("Indexed") != std::string::npos;
  if (has_indexer) cache.update_indexer(in.indexer, 0);
  return cache;
}

// What layer 0 holds: keys (seq axis), conv state 0 (time axis) and indexer keys (seq axis), as
// flat vectors in row-major order; empty when the layer has no such part.
struct Held {
  std::vector<double> keys, conv, indexer;
  std::int64_t keys_len = -1, conv_len = -1, indexer_len = -1;
};

Held held(const C& cache) {
  Held h;
  if (!cache.is_linear()[0]) {
    const auto kv = cache.stored(0);
    h.keys = kvc_test::flatten(kv.keys);
    h.keys_len = kv.keys.extent(2);
  }
  cache.visit_layer(0, [&](const auto& l) {
    auto take = [](const kvc::StateView<float>& v, std::vector<double>& out, std::int64_t& len, int axis) {
      for (std::int64_t i = 0; i < v.size(); ++i) out.push_back(v[i]);
      len = v.rank > axis ? v.extent(axis) : 0;
    };
    if constexpr (requires { l.conv_state(0); })
      take(l.conv_state(0), h.conv, h.conv_len, 2);
    else if constexpr (requires { l.linear_part(); })
      take(l.linear_part().conv_state(0), h.conv, h.conv_len, 2);
    if constexpr (requires { l.indexer_keys(); }) take(l.indexer_keys(), h.indexer, h.indexer_len, 1);
  });
  return h;
}

// keys[..., from:to, :] of a [B, H, S, D] tensor, flat.
std::vector<double> keys_slice(const kvc::HostTensor<float>& t, std::int64_t from, std::int64_t to) {
  return kvc_test::slice_seq(t, from, to - from);
}
// x[..., from:to] along the last axis of a [B, C, T] tensor, flat.
std::vector<double> last_axis_slice(const Conv& t, std::int64_t from, std::int64_t to) {
  std::vector<double> out;
  for (std::int64_t b = 0; b < t.dimension(0); ++b)
    for (std::int64_t c = 0; c < t.dimension(1); ++c)
      for (std::int64_t i = from; i < to; ++i) out.push_back(t(b, c, i));
  return out;
}
// x[:, from:to, :] along axis 1 of a [B, S, D] tensor, flat.
std::vector<double> middle_axis_slice(const Conv& t, std::int64_t from, std::int64_t to) {
  std::vector<double> out;
  for (std::int64_t b = 0; b < t.dimension(0); ++b)
    for (std::int64_t s = from; s < to; ++s)
      for (std::int64_t d = 0; d < t.dimension(2); ++d) out.push_back(t(b, s, d));
  return out;
}

std::vector<C::kind_variant> all_kinds() {
  return {kvc::DynamicLayer{},
          kvc::DynamicSlidingWindowLayer{window},
          kvc::LinearAttentionLayer{},
          kvc::LinearAttentionAndFullAttentionLayer{},
          kvc::LinearAttentionAndSlidingWindowAttentionLayer{{window}, 1},
          kvc::DynamicIndexedLayer{}};
}

}  // namespace

TEST_CASE("CacheCroppingTests: after recording 45 tokens every part holds 45") {
  const Inputs in = make_inputs();
  for (const auto& kind : all_kinds()) {
    const C cache = std::visit([&](const auto& k) { return filled(k, in); }, kind);
    CAPTURE(std::string(cache.layer_name(0)));
    const Held h = held(cache);
    CHECK((h.keys_len == -1 || h.keys_len == seq_len));
    CHECK((h.conv_len == -1 || h.conv_len == seq_len));
    CHECK((h.indexer_len == -1 || h.indexer_len == seq_len));
    CHECK(h.keys_len + h.conv_len + h.indexer_len > -3);  // every kind has at least one part
  }
}

TEST_CASE("test_crop_with_past: crop(-3): sliding keep 11 before the cut, the rest 42; conv the 4 before the cut") {
  const Inputs in = make_inputs();
  for (const auto& kind : all_kinds()) {
    C cache = std::visit([&](const auto& k) { return filled(k, in); }, kind);
    CAPTURE(std::string(cache.layer_name(0)));
    cache.crop(-3);
    const Held h = held(cache);
    if (h.keys_len >= 0) {
      if (cache.is_sliding(0)) {
        CHECK(h.keys_len == window - 1);
        CHECK(h.keys == keys_slice(in.keys, seq_len - 3 - (window - 1), seq_len - 3));
      } else {
        CHECK(h.keys_len == seq_len - 3);
        CHECK(h.keys == keys_slice(in.keys, 0, seq_len - 3));
      }
    }
    if (h.conv_len >= 0) {
      CHECK(h.conv_len == kernel);
      CHECK(h.conv == last_axis_slice(in.conv, seq_len - 3 - kernel, seq_len - 3));
    }
    if (h.indexer_len >= 0) {
      CHECK(h.indexer_len == seq_len - 3);
      CHECK(h.indexer == middle_axis_slice(in.indexer, 0, seq_len - 3));
    }
  }
}

TEST_CASE("test_crop_with_zero_still_shrink_states: crop(0) still shrinks sliding and conv states") {
  const Inputs in = make_inputs();
  for (const auto& kind : all_kinds()) {
    C cache = std::visit([&](const auto& k) { return filled(k, in); }, kind);
    CAPTURE(std::string(cache.layer_name(0)));
    cache.crop(0);
    const Held h = held(cache);
    if (h.keys_len >= 0) {
      const std::int64_t keep = cache.is_sliding(0) ? window - 1 : seq_len;
      CHECK(h.keys_len == keep);
      CHECK(h.keys == keys_slice(in.keys, seq_len - keep, seq_len));
    }
    if (h.conv_len >= 0) CHECK(h.conv == last_axis_slice(in.conv, seq_len - kernel, seq_len));
    if (h.indexer_len >= 0) CHECK(h.indexer_len == seq_len);
  }
}

TEST_CASE("test_crop_outside_range: crop(-46) empties every part") {
  const Inputs in = make_inputs();
  for (const auto& kind : all_kinds()) {
    C cache = std::visit([&](const auto& k) { return filled(k, in); }, kind);
    CAPTURE(std::string(cache.layer_name(0)));
    cache.crop(-46);
    const Held h = held(cache);
    CHECK(h.keys.empty());
    CHECK(h.conv.empty());
    CHECK(h.indexer.empty());
  }
}

TEST_CASE(
    "test_bc_crop_with_positive_value: a positive crop on DynamicLayer and DynamicIndexedLayer warns and keeps that many") {
  const Inputs in = make_inputs();
  for (const C::kind_variant kind :
       {C::kind_variant(kvc::DynamicLayer{}), C::kind_variant(kvc::DynamicIndexedLayer{})}) {
    kvc_test::captured_warnings warnings;
    C cache = std::visit([&](const auto& k) { return filled(k, in, false); }, kind);
    CAPTURE(std::string(cache.layer_name(0)));
    cache.crop(42);
    REQUIRE(warnings.messages.size() == 1);
    CHECK(warnings.messages.front().find("Calling `crop` with a positive value is deprecated and will be removed") !=
          std::string::npos);
    const Held h = held(cache);
    CHECK(h.keys == keys_slice(in.keys, 0, 42));
    CHECK((h.indexer_len == -1 || h.indexer == middle_axis_slice(in.indexer, 0, 42)));
  }
}
