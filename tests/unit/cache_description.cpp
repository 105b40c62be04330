// kvc::cache_from_description: caches described by JSON at run time, with the same two layer-source
// messages the compile-time check prints.

#include <kvc/cache_description.hpp>

#include "../support/kvc_test.hpp"

using kvc_test::seq;
using kvc_test::values_of;
using V = std::vector<float>;

TEST_CASE("both or neither layer source: the compile-time texts, as ValueError") {
  CHECK_THROWS_WITH_AS(
      kvc::cache_from_description(R"({"layers": [], "layer_class_to_replicate": "DynamicLayer"})"),
      "You can construct a Cache either from a list `layers` of all the predefined `CacheLayer`, or from a "
      "`layer_class_to_replicate`, in which case the Cache will append a new layer corresponding to "
      "`layer_class_to_replicate` for each new call to `update` with an idx not already in the Cache.",
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      kvc::cache_from_description(R"({"dtype": "float"})"),
      "You should provide exactly one of `layers` or `layer_class_to_replicate` to initialize a Cache.",
      kvc::ValueError);
}

TEST_CASE("pre-built layers of any kinds") {
  auto cache = kvc::cache_from_description(R"({"layers": ["DynamicLayer",
      {"type": "DynamicSlidingWindowLayer", "sliding_window": 2},
      {"type": "StaticLayer", "max_cache_len": 4},
      {"type": "StaticSlidingWindowLayer", "max_cache_len": 4, "sliding_window": 2}]})");
  REQUIRE(cache.size() == 4);
  CHECK(cache.layer_name(3) == "StaticSlidingWindowLayer");
  for (std::int64_t i = 0; i < 4; ++i) cache.update(seq({1, 2, 3}), seq({1, 2, 3}), i);
  CHECK(values_of(cache.stored<float>(0).keys) == V{1, 2, 3});
  CHECK(values_of(cache.stored<float>(1).keys) == V{3});
  CHECK(values_of(cache.stored<float>(2).keys) == V{1, 2, 3, 0});
  CHECK(values_of(cache.stored<float>(3).keys) == V{2, 3});
  // Layers are checked in order, as transformers' Cache.crop visits them: layer 1's window is full
  // and not recording, layer 2 cannot crop at all.
  CHECK_THROWS_AS(cache.crop(-1), kvc::RuntimeError);
  // Recording from now on does not bring back the token that left layer 1's window: crop(-1) stays
  // refused there (docs/rollback.md); crop(0) passes it and stops at layer 2.
  cache.activate_past_recording();
  CHECK_THROWS_AS(cache.crop(-1), kvc::RuntimeError);
  CHECK_THROWS_WITH_AS(cache.crop(0), "'StaticLayer' object has no attribute 'crop'", kvc::AttributeError);
  CHECK(cache.get_seq_length(0) == 3);
}

TEST_CASE("a replicated kind and the element type") {
  auto cache = kvc::cache_from_description(
      R"({"layer_class_to_replicate": {"type": "StaticLayer", "max_cache_len": 3}, "dtype": "bfloat16"})");
  CHECK(cache.element_type_name() == "bfloat16");
  cache.update(seq<Eigen::bfloat16>({5}), seq<Eigen::bfloat16>({5}), 2);
  CHECK(cache.size() == 3);
  CHECK(cache.get_max_length() == 3);
  CHECK(kvc::cache_from_description(R"({"layer_class_to_replicate": "DynamicLayer", "dtype": "double"})")
            .element_type_name() == "double");
}

TEST_CASE("malformed descriptions are ValueErrors naming the field") {
  using kvc::cache_from_description;
  CHECK_THROWS_AS(cache_from_description("{\"layers\": ["), kvc::ValueError);
  // A number too large for a double is nlohmann's out_of_range, not a parse_error (found by the fuzz.json test).
  CHECK_THROWS_WITH_AS(cache_from_description("1e999"),
                       "cache description: malformed JSON: [json.exception.out_of_range.406] number overflow parsing "
                       "'1e999'",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description("[1]"), "cache description: expected a JSON object, got [1]",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layers": {"type": "DynamicLayer"}})"),
                       "cache description: `layers` must be an array, got {\"type\":\"DynamicLayer\"}",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layers": [{"type": "StaticLayer"}]})"),
                       "cache description: `layers[0]` needs `max_cache_len`", kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layers": [{"type": "StaticLayer", "max_cache_len": "8"}]})"),
                       "cache description: `layers[0]` `max_cache_len` must be an integer, got \"8\"", kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      cache_from_description(R"({"layers": [{"type": "StaticLayer", "max_cache_len": 10000000000000}]})"),
      "cache description: `layers[0]` `max_cache_len` must be between 1 and 1099511627776, got 10000000000000",
      kvc::ValueError);
  // The value as written: 2^64 - 1 used to be reported as -1.
  CHECK_THROWS_WITH_AS(
      cache_from_description(R"({"layers": [{"type": "StaticLayer", "max_cache_len": 18446744073709551615}]})"),
      "cache description: `layers[0]` `max_cache_len` must be between 1 and 1099511627776, got 18446744073709551615",
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layers": ["StaticLayer"]})"),
                       "cache description: `layers[0]` needs `max_cache_len`", kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layer_class_to_replicate": {"type": "DynamicSlidingWindowLayer"}})"),
                       "cache description: `layer_class_to_replicate` needs `sliding_window`", kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      cache_from_description(
          R"({"layers": [{"type": "DynamicSlidingWindowLayer", "sliding_window": 4, "rollback_slack": -1}]})"),
      "cache description: `layers[0]` `rollback_slack` must be between 0 and 1099511627776, got -1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layers": [7]})"),
                       "cache description: `layers[0]` must be a kind name or an object, got 7", kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layers": [{"kind": "x"}]})"),
                       "cache description: `layers[0]` needs a string `type`", kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layers": ["MambaLayer"]})"),
                       "'MambaLayer' is not a known layer kind. Known layer kinds: ('DynamicLayer', "
                       "'DynamicSlidingWindowLayer', 'StaticLayer', 'StaticSlidingWindowLayer', "
                       "'QuantoQuantizedLayer', 'HQQQuantizedLayer')",
                       kvc::KeyError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layers": [], "dtype": "int8"})"),
                       "cache description: `dtype` must be one of ('float', 'double', 'half', 'bfloat16'), got 'int8'",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache_from_description(R"({"layers": [], "dtype": 4})"),
                       "cache description: `dtype` must be a string, got 4", kvc::ValueError);
}

TEST_CASE("hostile descriptions: deep nesting, and a buffer above the allocation limit") {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');  // used to overflow the stack
  CHECK_THROWS_WITH_AS(kvc::cache_from_description(R"({"layers": )" + deep + "}"),
                       "cache description: the JSON nests arrays and objects deeper than kvc's limit of 128 levels",
                       kvc::ValueError);
  // A StaticLayer of 2^31 slots is a valid description; its buffer for 256 heads of 128 is 2^48
  // bytes: refused with the limit's message (it used to reach the allocator: std::bad_alloc).
  auto cache = kvc::cache_from_description(R"({"layers": [{"type": "StaticLayer", "max_cache_len": 2147483648}]})");
  kvc::HostTensor<float> k(1, 256, 1, 128);
  k.setZero();
  CHECK_THROWS_WITH_AS(cache.update(k, k, 0),
                       "kvc: a buffer of [1, 256, 2147483648, 128] elements of 4 bytes is larger than kvc's allocation "
                       "limit of 1099511627776 bytes (kvc::set_allocation_limit)",
                       kvc::ValueError);
  CHECK_FALSE(cache.is_initialized());
  CHECK(cache.bytes() == 0);
}

TEST_CASE("a sliding layer's rollback_slack: kept past the window, so that crop(-n) up to it is exact") {
  auto cache = kvc::cache_from_description(
      R"({"layers": [{"type": "DynamicSlidingWindowLayer", "sliding_window": 4, "rollback_slack": 2}]})");
  std::mt19937 rng(5);
  const auto k = kvc_test::random_tensor<float>(1, 1, 8, 2, rng);
  cache.update(k, k, 0);
  CHECK(cache.get_seq_length() == 8);
  CHECK(cache.rollback_depth() == 2);
  cache.crop(-2);  // the window slid, yet 2 tokens come back exactly (docs/rollback.md)
  CHECK(cache.get_seq_length() == 6);
  CHECK(kvc_test::flatten(cache.stored<float>(0).keys) == kvc_test::slice_seq(k, 3, 3));
  CHECK_THROWS_AS(cache.crop(-1), kvc::RuntimeError);
}

TEST_CASE("quantized kinds: a format per layer, the first and last layers in full precision") {
  auto cache = kvc::cache_from_description(R"({"layers": ["DynamicLayer",
      {"type": "QuantoQuantizedLayer", "nbits": 2, "residual_length": 2, "q_group_size": 4},
      {"type": "HQQQuantizedLayer", "nbits": 8, "axis_key": 1, "rotate_keys": true, "residual_length": 2},
      "DynamicLayer"]})");
  REQUIRE(cache.size() == 4);
  CHECK(cache.layer_name(1) == "QuantoQuantizedLayer");
  CHECK(cache.layer_name(2) == "HQQQuantizedLayer");
  // Each layer holds what its kind holds: the full-precision ones exactly, int8 within a step (what
  // the next update returns: the history dequantized, then the new token).
  const std::vector<float> x = {0.5f, -1.25f, 2.0f, 0.75f};
  for (std::int64_t i = 0; i < 4; ++i) cache.update(seq(x), seq(x), i);
  std::vector<V> read;
  for (std::int64_t i = 0; i < 4; ++i) read.push_back(values_of(cache.update(seq({1.0f}), seq({1.0f}), i).keys));
  CHECK(read[0] == V{0.5f, -1.25f, 2.0f, 0.75f, 1.0f});
  CHECK(read[3] == read[0]);
  REQUIRE(read[2].size() == 5);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(std::abs(read[2][i] - x[i]) < 0.02f);
  CHECK(read[1] != read[0]);  // int2: coarse
  // Defaults where a field is absent; the codec's checks and messages.
  CHECK(kvc::cache_from_description(R"({"layer_class_to_replicate": "QuantoQuantizedLayer"})").size() == 0);
  CHECK_THROWS_WITH_AS(kvc::cache_from_description(R"({"layers": [{"type": "QuantoQuantizedLayer", "nbits": 3}]})"),
                       "`nbits` for `quanto` backend has to be one of [`2`, `4`] but got 3", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::cache_from_description(R"({"layers": [{"type": "HQQQuantizedLayer", "axis_key": -1}]})"),
                       "`axis_key` for `HQQ` backend has to be one of [`0`, `1`] but got -1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      kvc::cache_from_description(R"({"layers": ["DynamicLayer", {"type": "HQQQuantizedLayer", "append_only": 1}]})"),
      "cache description: `layers[1]` `append_only` must be true or false, got 1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::cache_from_description(R"({"layers": [{"type": "QuantoQuantizedLayer", "axis_key": -2}]})"),
                       "cache description: `layers[0]` `axis_key` must be between -1 and 1099511627776, got -2",
                       kvc::ValueError);
  // kvc's value_nbits: the values' own width, checked as nbits is.
  CHECK(
      kvc::cache_from_description(
          R"({"layers": [{"type": "HQQQuantizedLayer", "nbits": 8, "axis_key": 1, "axis_value": 1, "value_nbits": 2}]})")
          .size() == 1);
  CHECK_THROWS_WITH_AS(
      kvc::cache_from_description(R"({"layers": [{"type": "HQQQuantizedLayer", "value_nbits": 5}]})"),
      "HQQQuantizedLayer: `value_nbits` has to be 0 (the keys' nbits) or one of [`1`, `2`, `3`, `4`, `8`], got 5",
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      kvc::cache_from_description(R"({"layers": [{"type": "QuantoQuantizedLayer", "value_nbits": -1}]})"),
      "cache description: `layers[0]` `value_nbits` must be between 0 and 1099511627776, got -1", kvc::ValueError);
}
