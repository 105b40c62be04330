// DynamicSlidingWindowLayer: transformers' DynamicSlidingWindowLayer (src/transformers/cache_utils.py
// at a597f974: worked examples, crop rules, both RuntimeErrors), the scenarios of its
// CacheCroppingTests and test_dynamic_layers_reset_drops_their_states, and the returned width
// matching get_mask_sizes (test_update_with_recording_returns_advertised_kv_width).

#include "../support/kvc_test.hpp"
#include "../support/sanitized.hpp"

using kvc_test::seq;
using kvc_test::values_of;
using V = std::vector<float>;
using SlidingCache = kvc::Cache<kvc::Replicate<kvc::DynamicSlidingWindowLayer>>;

namespace {
using mask = std::pair<std::int64_t, std::int64_t>;

const char* const not_recording =
    "`crop` was called, but the current layer does not track past states, and the sliding window size was already "
    "reached. Call `activate_past_recording` before `crop` to be able to rollback the cache.";
const char* const positive_after_window =
    "Once the sliding window size has been reached, `DynamicSlidingWindowLayer` can only be cropped by passing a "
    "negative int, to specify how many tokens to remove";
}  // namespace

TEST_CASE("worked example (window 4, no recording)") {
  SlidingCache cache(kvc::DynamicSlidingWindowLayer{4});
  struct step {
    V input;
    mask sizes;
    V returned;
    V stored;
    std::int64_t cum;
  };
  const std::vector<step> steps{{{1, 2, 3}, {3, 0}, {1, 2, 3}, {1, 2, 3}, 3},
                                {{4}, {4, 0}, {1, 2, 3, 4}, {2, 3, 4}, 4},
                                {{5}, {4, 1}, {2, 3, 4, 5}, {3, 4, 5}, 5},
                                {{6, 7}, {5, 2}, {3, 4, 5, 6, 7}, {5, 6, 7}, 7}};
  for (const auto& s : steps) {
    CAPTURE(s.cum);
    CHECK(cache.get_mask_sizes(static_cast<std::int64_t>(s.input.size()), 0) ==
          (cache.size() ? s.sizes : mask{static_cast<std::int64_t>(s.input.size()), 0}));
    const auto kv = cache.update(seq(s.input), seq(s.input), 0);
    CHECK(values_of(kv.keys) == s.returned);
    CHECK(values_of(kv.values) == s.returned);
    CHECK(values_of(cache.stored(0).keys) == s.stored);
    CHECK(cache.get_seq_length() == s.cum);
  }
  CHECK(cache.get_max_length(0) == 4);
  CHECK(cache.is_sliding() == std::vector<bool>{true});
}

TEST_CASE(
    "with recording, update returns exactly the advertised kv_length (test_update_with_recording_returns_advertised_kv_width)") {
  SlidingCache cache(kvc::DynamicSlidingWindowLayer{4});
  cache.update(seq({}), seq({}), 0);  // creates the layer; a zero-token update adds nothing
  cache.activate_past_recording();
  const std::vector<V> expected{{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {1, 2, 3, 4}, {2, 3, 4, 5}};
  for (int step = 0; step < 6; ++step) {
    const auto [kv_length, kv_offset] = cache.get_mask_sizes(1, 0);
    const auto kv = cache.update(seq({float(step)}), seq({float(step)}), 0);
    CHECK(kv.keys.extent(2) == kv_length);
    CHECK(values_of(kv.keys) == expected[static_cast<std::size_t>(step)]);
    CHECK(cache.stored(0).keys.extent(2) == step + 1);
    CHECK(kv_offset == std::max(step - 3, 0));
  }
}

TEST_CASE("with recording, a multi-token update that crosses the window") {
  SlidingCache cache(kvc::DynamicSlidingWindowLayer{4});
  cache.update(seq({0}), seq({0}), 0);
  cache.activate_past_recording();
  cache.update(seq({1}), seq({1}), 0);
  CHECK(cache.get_mask_sizes(3, 0).first == 5);
  auto kv = cache.update(seq({2, 3, 4}), seq({2, 3, 4}), 0);
  CHECK(values_of(kv.keys) == V{0, 1, 2, 3, 4});
  CHECK(cache.stored(0).keys.extent(2) == 5);
  CHECK(cache.get_mask_sizes(1, 0).first == 4);
  kv = cache.update(seq({5}), seq({5}), 0);
  CHECK(values_of(kv.keys) == V{2, 3, 4, 5});
}

TEST_CASE("crop past the window (sliding_window 12, 45 tokens, CacheCroppingTests)") {
  std::mt19937 rng(12);
  const auto keys = kvc_test::random_tensor<float>(2, 32, 45, 32, rng);
  const auto values = kvc_test::random_tensor<float>(2, 32, 45, 32, rng);
  auto recorded = [&] {
    SlidingCache c(kvc::DynamicSlidingWindowLayer{12});
    c.update(seq({}), seq({}), 0);
    c.reset();
    c.activate_past_recording();
    c.update(keys, values, 0);
    REQUIRE(c.stored(0).keys.extent(2) == 45);
    return c;
  };
  SUBCASE("crop(-3) keeps the 11 tokens before the last 3") {
    auto c = recorded();
    c.crop(-3);
    CHECK(kvc_test::flatten(c.stored(0).keys) == kvc_test::slice_seq(keys, 45 - 14, 11));
    CHECK(kvc_test::flatten(c.stored(0).values) == kvc_test::slice_seq(values, 45 - 14, 11));
    CHECK(c.get_seq_length() == 42);
  }
  SUBCASE("crop(0) still shrinks the recorded states to window - 1") {
    auto c = recorded();
    c.crop(0);
    CHECK(kvc_test::flatten(c.stored(0).keys) == kvc_test::slice_seq(keys, 45 - 11, 11));
    CHECK(c.get_seq_length() == 45);
  }
  SUBCASE("crop(-46) empties the layer and the count stops at 0") {
    auto c = recorded();
    c.crop(-46);
    CHECK(c.stored(0).keys.size() == 0);
    CHECK(c.stored(0).values.size() == 0);
    CHECK(c.get_seq_length() == 0);  // transformers: -1 (docs/differences.md)
    CHECK(c.get_mask_sizes(2, 0) == mask{2, 0});
    const kvc::HostTensor<float> none(2, 32, 0, 32);
    CHECK(c.update(none, none, 0).keys.extent(2) == 0);
  }
  SUBCASE("without recording, crop after the window is a RuntimeError that changes nothing") {
    SlidingCache c(kvc::DynamicSlidingWindowLayer{12});
    c.update(keys, values, 0);
    const auto before = kvc_test::take_snapshot(c);
    CHECK_THROWS_WITH_AS(c.crop(-3), not_recording, kvc::RuntimeError);
    CHECK_THROWS_WITH_AS(c.crop(0), not_recording, kvc::RuntimeError);
    CHECK(kvc_test::take_snapshot(c) == before);
  }
  SUBCASE("with recording, a positive crop after the window is the other RuntimeError") {
    auto c = recorded();
    const auto before = kvc_test::take_snapshot(c);
    CHECK_THROWS_WITH_AS(c.crop(3), positive_after_window, kvc::RuntimeError);
    CHECK(kvc_test::take_snapshot(c) == before);
  }
}

TEST_CASE("crop then decode: the window continues from the rolled-back position") {
  SlidingCache cache(kvc::DynamicSlidingWindowLayer{4});
  cache.update(seq({}), seq({}), 0);
  cache.activate_past_recording();
  for (int i = 0; i < 10; ++i) cache.update(seq({float(i)}), seq({float(i)}), 0);
  cache.crop(-3);  // drops 7, 8, 9
  CHECK(cache.get_seq_length() == 7);
  CHECK(values_of(cache.stored(0).keys) == V{4, 5, 6});
  const auto [kv_length, kv_offset] = cache.get_mask_sizes(1, 0);
  CHECK(kv_length == 4);
  CHECK(kv_offset == 4);
  const auto kv = cache.update(seq({70}), seq({70}), 0);
  CHECK(values_of(kv.keys) == V{4, 5, 6, 70});
}

TEST_CASE("crop before the window is reached follows DynamicLayer and resets the count") {
  kvc_test::captured_warnings w;
  SlidingCache cache(kvc::DynamicSlidingWindowLayer{12});
  cache.update(seq({1, 2, 3, 4, 5}), seq({1, 2, 3, 4, 5}), 0);
  cache.crop(-2);
  CHECK(values_of(cache.stored(0).keys) == V{1, 2, 3});
  CHECK(cache.get_seq_length() == 3);
  cache.crop(2);  // deprecated absolute length, below the window: allowed, warns
  CHECK(values_of(cache.stored(0).keys) == V{1, 2});
  CHECK(cache.get_seq_length() == 2);
  CHECK(w.messages.size() == 1);
  cache.crop(0);
  CHECK(cache.get_seq_length() == 2);
}

TEST_CASE("reset drops the states (test_dynamic_layers_reset_drops_their_states for DynamicSlidingWindowLayer(1024))") {
  std::mt19937 rng(3);
  SlidingCache cache(kvc::DynamicSlidingWindowLayer{1024});
  cache.update(kvc_test::random_tensor<float>(2, 4, 5, 16, rng), kvc_test::random_tensor<float>(2, 4, 5, 16, rng), 0);
  cache.reset();
  CHECK(cache.get_seq_length() == 0);
  const auto kv = cache.update(kvc_test::random_tensor<float>(2, 4, 5, 16, rng),
                               kvc_test::random_tensor<float>(2, 4, 5, 16, rng), 0);
  CHECK(kv.keys.extent(2) == 5);
}

TEST_CASE("a window of 1 keeps nothing between updates") {
  SlidingCache cache(kvc::DynamicSlidingWindowLayer{1});
  cache.update(seq({1, 2}), seq({1, 2}), 0);
  CHECK(cache.stored(0).keys.extent(2) == 0);
  CHECK(cache.get_mask_sizes(1, 0) == mask{1, 2});
  CHECK(values_of(cache.update(seq({3}), seq({3}), 0).keys) == V{3});
}

TEST_CASE("a non-positive window is a ValueError") {
  CHECK_THROWS_WITH_AS(SlidingCache(kvc::DynamicSlidingWindowLayer{0}),
                       "DynamicSlidingWindowLayer: sliding_window must be a positive integer, got 0", kvc::ValueError);
}

TEST_CASE_TEMPLATE_DEFINE("random update sizes: the returned window is the tail of the history", T, sliding_random) {
  // Under the sanitizers, float and double: the 16-bit types take the same paths, and the time goes
  // to this test's own concatenations (the g++ build runs all four, natively and under valgrind).
  if (kvc_test::sanitized && (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>)) return;
  std::mt19937 rng(99);
  for (const bool record : {false, true}) {
    for (const std::int64_t window : {1, 3, 8, 33}) {
      CAPTURE(record);
      CAPTURE(window);
      kvc::Cache<kvc::Replicate<kvc::DynamicSlidingWindowLayer>, kvc::HostStorage<T>> cache(
          kvc::DynamicSlidingWindowLayer{window});
      if (record) {
        cache.update(kvc::HostTensor<T>(2, 3, 0, 5), kvc::HostTensor<T>(2, 3, 0, 7), 0);
        cache.activate_past_recording();
      }
      kvc::HostTensor<T> all_k(2, 3, 0, 5), all_v(2, 3, 0, 7);
      std::int64_t seen = 0;
      for (int step = 0; step < 60; ++step) {
        const std::int64_t q = std::uniform_int_distribution<std::int64_t>(0, 2 * window + 1)(rng);
        const auto k = kvc_test::random_tensor<T>(2, 3, q, 5, rng);
        const auto v = kvc_test::random_tensor<T>(2, 3, q, 7, rng);
        const auto [kv_length, kv_offset] = cache.get_mask_sizes(q, 0);
        const auto kv = cache.update(k, v, 0);
        all_k = kvc_test::cat(all_k, k);
        all_v = kvc_test::cat(all_v, v);
        seen += q;
        REQUIRE(kv.keys.extent(2) == kv_length);
        REQUIRE(kv.values.extent(3) == 7);
        REQUIRE(kv_offset == seen - kv_length);
        REQUIRE(kvc_test::flatten(kv.keys) == kvc_test::slice_seq(all_k, seen - kv_length, kv_length));
        REQUIRE(kvc_test::flatten(kv.values) == kvc_test::slice_seq(all_v, seen - kv_length, kv_length));
        REQUIRE(cache.get_seq_length() == seen);
        const std::int64_t stored = cache.stored(0).keys.extent(2);
        REQUIRE(stored == (record ? seen : std::min(seen, window - 1)));
      }
      // Memory stays bounded without recording: about twice (window + largest update).
      if (!record) CHECK(cache.bytes() <= std::int64_t(sizeof(T)) * 2 * 3 * (5 + 7) * 2 * (3 * window + 2 + 16));
    }
  }
}
TEST_CASE_TEMPLATE_APPLY(sliding_random, kvc_test::element_types);
