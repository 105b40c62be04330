// StaticSlidingWindowLayer: the five paths of transformers' StaticSlidingWindowLayer.update
// (src/transformers/cache_utils.py at a597f974) with one counter, worked examples, and the sliding,
// hybrid and chunked static caches of transformers' SyntheticCacheTest (test_sliding_window_cache,
// test_hybrid_cache, test_hybrid_chunked_cache, test_hybrid_chunked_cache_extra_cases).

#include "../support/kvc_test.hpp"

using kvc_test::seq;
using kvc_test::values_of;
using V = std::vector<float>;
using mask = std::pair<std::int64_t, std::int64_t>;
using Window = kvc::Cache<kvc::Layers<kvc::StaticSlidingWindowLayer>>;

namespace {
kvc::ModelConfig config(std::vector<std::string> types, std::optional<std::int64_t> sliding,
                        std::optional<std::int64_t> chunk) {
  kvc::ModelConfig c;
  c.num_hidden_layers = static_cast<std::int64_t>(types.size());
  c.num_attention_heads = 1;
  c.num_key_value_heads = 1;
  c.head_dim = 1;
  c.hidden_size = 1;
  c.sliding_window = sliding;
  c.attention_chunk_size = chunk;
  c.layer_types = std::move(types);
  return c;
}
}  // namespace

TEST_CASE("sliding window cache scenarios (test_sliding_window_cache, W = 4)") {
  const auto c = config({"sliding_attention"}, 4, 4);
  SUBCASE("fits") {
    kvc::StaticCache<float> cache(c, 4);
    cache.update(seq({1, 2}), seq({1, 2}), 0);
    cache.update(seq({3}), seq({3}), 0);
    CHECK(values_of(cache.stored(0).keys) == V{1, 2, 3, 0});
  }
  SUBCASE("full, one token") {
    kvc::StaticCache<float> cache(c, 4);
    cache.update(seq({1, 2, 3, 4}), seq({1, 2, 3, 4}), 0);
    const auto kv = cache.update(seq({5}), seq({5}), 0);
    CHECK(values_of(cache.stored(0).keys) == V{2, 3, 4, 5});
    CHECK(values_of(kv.keys) == V{2, 3, 4, 5});
  }
  SUBCASE("prefill longer than the window") {
    kvc::StaticCache<float> cache(c, 4);
    const auto kv = cache.update(seq({1, 2, 3, 4, 5, 6}), seq({1, 2, 3, 4, 5, 6}), 0);
    CHECK(values_of(cache.stored(0).keys) == V{3, 4, 5, 6});
    CHECK(values_of(kv.keys) == V{1, 2, 3, 4, 5, 6});
    CHECK(cache.get_seq_length() == 6);
  }
}

TEST_CASE("hybrid cache (test_hybrid_cache: full + sliding 2, max_cache_len 4)") {
  kvc::StaticCache<float> cache(config({"full_attention", "sliding_attention"}, 2, std::nullopt), 4);
  CHECK(cache.layer_name(0) == "StaticLayer");
  CHECK(cache.layer_name(1) == "StaticSlidingWindowLayer");
  auto kv = cache.update(seq({1, 2, 3}), seq({1, 2, 3}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{1, 2, 3, 0});
  CHECK(values_of(kv.keys) == V{1, 2, 3, 0});
  kv = cache.update(seq({10, 20, 30}), seq({10, 20, 30}), 1);
  CHECK(values_of(cache.stored(1).keys) == V{20, 30});
  CHECK(values_of(kv.keys) == V{10, 20, 30});
  cache.update(seq({5}), seq({5}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{1, 2, 3, 5});
  cache.update(seq({50}), seq({50}), 1);
  CHECK(values_of(cache.stored(1).keys) == V{30, 50});
  CHECK(cache.is_sliding() == std::vector<bool>{false, true});
  CHECK(cache.get_max_length() == 4);
  CHECK(cache.get_max_length(1) == 2);
}

TEST_CASE("hybrid chunked cache (test_hybrid_chunked_cache: chunk 2, no sliding_window)") {
  kvc::StaticCache<float> cache(config({"full_attention", "chunked_attention"}, std::nullopt, 2), 4);
  CHECK(values_of(cache.update(seq({1, 2, 3}), seq({1, 2, 3}), 0).keys) == V{1, 2, 3, 0});
  CHECK(values_of(cache.update(seq({10, 20, 30}), seq({10, 20, 30}), 1).keys) == V{10, 20, 30});
  CHECK(values_of(cache.stored(1).keys) == V{20, 30});
  cache.update(seq({5}), seq({5}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{1, 2, 3, 5});
  CHECK(values_of(cache.update(seq({50}), seq({50}), 1).keys) == V{30, 50});
  CHECK(values_of(cache.stored(1).keys) == V{30, 50});
  CHECK(values_of(cache.update(seq({60, 70}), seq({60, 70}), 1).keys) == V{50, 60, 70});
  CHECK(values_of(cache.stored(1).keys) == V{60, 70});
}

TEST_CASE("chunked extra cases (test_hybrid_chunked_cache_extra_cases: chunk 3, max_cache_len 3)") {
  kvc::StaticCache<float> cache(config({"chunked_attention"}, std::nullopt, 3), 3);
  auto kv = cache.update(seq({10, 20}), seq({10, 20}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{10, 20, 0});
  CHECK(values_of(kv.keys) == V{10, 20, 0});
  kv = cache.update(seq({30, 40}), seq({30, 40}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{20, 30, 40});
  CHECK(values_of(kv.keys) == V{10, 20, 30, 40});
}

TEST_CASE("worked example W = 2 and the window is min(sliding_window, max_cache_len)") {
  Window cache(kvc::StaticSlidingWindowLayer{8, 2});
  CHECK(cache.get_max_length(0) == 2);
  CHECK(values_of(cache.update(seq({10, 20, 30}), seq({10, 20, 30}), 0).keys) == V{10, 20, 30});
  CHECK(values_of(cache.stored(0).keys) == V{20, 30});
  CHECK(values_of(cache.update(seq({50}), seq({50}), 0).keys) == V{30, 50});
  CHECK(values_of(cache.update(seq({60, 70}), seq({60, 70}), 0).keys) == V{50, 60, 70});
  CHECK(values_of(cache.stored(0).keys) == V{60, 70});
  Window small(kvc::StaticSlidingWindowLayer{3, 100});
  CHECK(small.get_max_length(0) == 3);
}

TEST_CASE("get_mask_sizes in each branch, asked before the update") {
  Window cache(kvc::StaticSlidingWindowLayer{4, 4});
  CHECK(cache.get_mask_sizes(2, 0) == mask{4, 0});  // nothing seen yet: fits
  cache.update(seq({1}), seq({1}), 0);
  CHECK(cache.get_mask_sizes(2, 0) == mask{4, 0});  // fits: the static buffer size
  CHECK(cache.get_mask_sizes(4, 0) == mask{5, 0});  // becoming full: cum + q
  cache.update(seq({2, 3}), seq({2, 3}), 0);
  CHECK(cache.get_mask_sizes(2, 0) == mask{5, 0});  // crossing, cum = 3: offset max(0, 0)
  cache.update(seq({4, 5}), seq({4, 5}), 0);
  CHECK(cache.get_seq_length() == 5);
  CHECK(cache.get_mask_sizes(1, 0) == mask{4, 2});  // full: W + q - 1, cum - W + 1
  CHECK(cache.get_mask_sizes(3, 0) == mask{6, 2});
}

TEST_CASE_TEMPLATE_DEFINE("random updates: one counter, returned width = get_mask_sizes, window = last W", T,
                          static_sliding_random) {
  std::mt19937 rng(2024);
  for (const std::int64_t w : {1, 2, 5, 16}) {
    CAPTURE(w);
    kvc::Cache<kvc::Layers<kvc::StaticSlidingWindowLayer>, kvc::HostStorage<T>> cache(
        kvc::StaticSlidingWindowLayer{w, w});
    kvc::HostTensor<T> all(1, 2, 0, 3);
    std::int64_t seen = 0;
    for (int step = 0; step < 80; ++step) {
      const std::int64_t q = step % 7 == 0 ? std::uniform_int_distribution<std::int64_t>(1, 3 * w)(rng) : 1;
      const auto k = kvc_test::random_tensor<T>(1, 2, q, 3, rng);
      const auto [kv_length, kv_offset] = cache.get_mask_sizes(q, 0);
      const auto kv = cache.update(k, k, 0);
      all = kvc_test::cat(all, k);
      seen += q;
      REQUIRE(kv.keys.extent(2) == kv_length);
      if (seen <= w) {
        // fits: the window buffer, zeros after the tokens seen
        REQUIRE(kv_offset == 0);
        for (std::int64_t h = 0; h < 2; ++h)
          for (std::int64_t s = 0; s < w; ++s)
            for (std::int64_t d = 0; d < 3; ++d)
              REQUIRE(static_cast<double>(kv.keys(0, h, s, d)) ==
                      (s < seen ? static_cast<double>(all(0, h, s, d)) : 0.0));
      } else {
        REQUIRE(kv_offset == seen - kv_length);
        REQUIRE(kvc_test::flatten(kv.keys) == kvc_test::slice_seq(all, seen - kv_length, kv_length));
      }
      const auto window = cache.stored(0).keys;
      REQUIRE(window.extent(2) == w);
      if (seen >= w) REQUIRE(kvc_test::flatten(window) == kvc_test::slice_seq(all, seen - w, w));
      REQUIRE(cache.get_seq_length() == seen);
    }
    const auto bytes = cache.bytes();
    for (int step = 0; step < 50; ++step)
      cache.update(kvc_test::random_tensor<T>(1, 2, 1, 3, rng), kvc_test::random_tensor<T>(1, 2, 1, 3, rng), 0);
    CHECK(cache.bytes() == bytes);  // single-token decode never allocates
    cache.reset();
    CHECK(cache.get_seq_length() == 0);
    for (double x : kvc_test::flatten(cache.stored(0).keys)) REQUIRE(x == 0.0);
  }
}
TEST_CASE_TEMPLATE_APPLY(static_sliding_random, kvc_test::element_types);

TEST_CASE("non-positive sizes are ValueErrors") {
  CHECK_THROWS_WITH_AS(Window(kvc::StaticSlidingWindowLayer{0, 4}),
                       "StaticSlidingWindowLayer: max_cache_len must be a positive integer, got 0", kvc::ValueError);
  CHECK_THROWS_WITH_AS(Window(kvc::StaticSlidingWindowLayer{4, -1}),
                       "StaticSlidingWindowLayer: sliding_window must be a positive integer, got -1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::Cache<kvc::Layers<kvc::StaticLayer>>(kvc::StaticLayer{0}),
                       "StaticLayer: max_cache_len must be a positive integer, got 0", kvc::ValueError);
}
