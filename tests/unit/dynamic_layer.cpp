// DynamicLayer through kvc::DynamicCache (replicated) and standalone: transformers' DynamicLayer
// (src/transformers/cache_utils.py at a597f974) and, for the full-attention layer, the scenarios of
// tests/utils/test_cache_utils.py: test_dynamic_cache, test_dynamic_cache_batch_select_indices,
// test_dynamic_layers_reset_drops_their_states (transformers #48809) and CacheCroppingTests.

#include "../support/kvc_test.hpp"
#include "../support/sanitized.hpp"

#include <algorithm>
#include <cstdint>

using kvc_test::seq;
using kvc_test::values_of;
using V = std::vector<float>;

TEST_CASE("DynamicCache scenario 1: appends along seq (test_dynamic_cache)") {
  kvc::DynamicCache<float> cache;
  cache.update(seq({1, 2}), seq({1, 2}), 0);
  auto [k, v] = cache.update(seq({3}), seq({3}), 0);
  CHECK(values_of(k) == V{1, 2, 3});
  CHECK(values_of(v) == V{1, 2, 3});
  k = cache.update(seq({4}), seq({4}), 0).keys;
  CHECK(values_of(k) == V{1, 2, 3, 4});
  CHECK(cache.get_seq_length() == 4);
  CHECK(cache.get_max_length(0) == -1);
}

TEST_CASE("DynamicCache scenario 2: interleaved layers") {
  kvc::DynamicCache<float> cache;
  cache.update(seq({1, 2}), seq({1, 2}), 0);
  cache.update(seq({10, 20}), seq({10, 20}), 1);
  cache.update(seq({3}), seq({3}), 0);
  cache.update(seq({30}), seq({30}), 1);
  cache.update(seq({4}), seq({4}), 0);
  cache.update(seq({40}), seq({40}), 1);
  CHECK(values_of(cache.stored(0).keys) == V{1, 2, 3, 4});
  CHECK(values_of(cache.stored(1).keys) == V{10, 20, 30, 40});
  CHECK(values_of(cache.stored(1).values) == V{10, 20, 30, 40});
}

TEST_CASE("batch_select_indices keeps the chosen rows (test_dynamic_cache_batch_select_indices)") {
  kvc::DynamicCache<float> cache;
  kvc::HostTensor<float> t(3, 1, 2, 1);
  const float rows[3][2] = {{1, 2}, {10, 20}, {100, 200}};
  for (int b = 0; b < 3; ++b)
    for (int s = 0; s < 2; ++s) t(b, 0, s, 0) = rows[b][s];
  cache.update(t, t, 0);
  CHECK(cache.stored(0).keys.extent(0) == 3);
  cache.batch_select_indices({0, 2});
  const auto k = cache.stored(0).keys;
  CHECK(k.extent(0) == 2);
  CHECK(values_of(k, 0) == V{1, 2});
  CHECK(values_of(k, 1) == V{100, 200});
}

TEST_CASE("batch_repeat_interleave and reorder_cache act on every row") {
  kvc::DynamicCache<float> cache;
  kvc::HostTensor<float> t(2, 1, 2, 1);
  t(0, 0, 0, 0) = 1;
  t(0, 0, 1, 0) = 2;
  t(1, 0, 0, 0) = 3;
  t(1, 0, 1, 0) = 4;
  cache.update(t, t, 0);
  cache.batch_repeat_interleave(2);
  auto k = cache.stored(0).keys;
  REQUIRE(k.extent(0) == 4);
  CHECK(values_of(k, 0) == V{1, 2});
  CHECK(values_of(k, 1) == V{1, 2});
  CHECK(values_of(k, 2) == V{3, 4});
  CHECK(values_of(k, 3) == V{3, 4});
  cache.reorder_cache({3, 0, 0, 1});
  k = cache.stored(0).keys;
  CHECK(values_of(k, 0) == V{3, 4});
  CHECK(values_of(k, 1) == V{1, 2});
  CHECK(values_of(k, 3) == V{1, 2});
  CHECK(cache.batch_size() == 4);
  // The next update continues every reordered row.
  kvc::HostTensor<float> n(4, 1, 1, 1);
  n.setValues({{{{5}}}, {{{6}}}, {{{7}}}, {{{8}}}});
  k = cache.update(n, n, 0).keys;
  CHECK(values_of(k, 0) == V{3, 4, 5});
  CHECK(values_of(k, 3) == V{1, 2, 8});
}

TEST_CASE("reset drops the states: the next update starts afresh (transformers #48809)") {
  std::mt19937 rng(13);
  kvc::DynamicCache<float> cache;
  cache.update(kvc_test::random_tensor<float>(2, 4, 5, 16, rng), kvc_test::random_tensor<float>(2, 4, 5, 16, rng), 0);
  CHECK(cache.bytes() > 0);
  cache.reset();
  CHECK(cache.get_seq_length(0) == 0);
  CHECK(cache.bytes() == 0);
  CHECK_FALSE(cache.is_initialized());
  const auto kv = cache.update(kvc_test::random_tensor<float>(2, 4, 5, 16, rng),
                               kvc_test::random_tensor<float>(2, 4, 5, 16, rng), 0);
  CHECK(kv.keys.extent(2) == 5);
  // After a reset the layer may take a different shape.
  cache.reset();
  CHECK(
      cache.update(kvc_test::random_tensor<float>(1, 2, 3, 8, rng), kvc_test::random_tensor<float>(1, 2, 3, 8, rng), 0)
          .keys.extent(1) == 2);
}

TEST_CASE("crop rules of DynamicLayer (DynamicLayer.crop, CacheCroppingTests)") {
  std::mt19937 rng(45);
  const auto keys = kvc_test::random_tensor<float>(2, 32, 45, 32, rng);
  const auto values = kvc_test::random_tensor<float>(2, 32, 45, 32, rng);
  auto fresh = [&] {
    kvc::DynamicCache<float> c;
    c.update(keys, values, 0);
    return c;
  };
  SUBCASE("crop(-3) removes the last 3 tokens") {
    auto c = fresh();
    c.crop(-3);
    CHECK(c.get_seq_length() == 42);
    CHECK(kvc_test::flatten(c.stored(0).keys) == kvc_test::slice_seq(keys, 0, 42));
    CHECK(kvc_test::flatten(c.stored(0).values) == kvc_test::slice_seq(values, 0, 42));
  }
  SUBCASE("crop(0) changes nothing for a full-attention layer") {
    auto c = fresh();
    c.crop(0);
    CHECK(kvc_test::flatten(c.stored(0).keys) == kvc_test::slice_seq(keys, 0, 45));
  }
  SUBCASE("crop(-46) empties the layer") {
    auto c = fresh();
    c.crop(-46);
    CHECK(c.get_seq_length() == 0);
    CHECK(c.stored(0).keys.size() == 0);
    CHECK(c.stored(0).values.size() == 0);
  }
  SUBCASE("a positive value is the deprecated absolute length and warns once") {
    kvc_test::captured_warnings w;
    auto c = fresh();
    c.crop(42);
    CHECK(c.get_seq_length() == 42);
    CHECK(kvc_test::flatten(c.stored(0).keys) == kvc_test::slice_seq(keys, 0, 42));
    c.crop(50);  // longer than held: nothing happens
    CHECK(c.get_seq_length() == 42);
    REQUIRE(w.messages.size() == 1);
    CHECK(w.messages[0] ==
          "Calling `crop` with a positive value is deprecated and will be removed in version 5.18. Please use a "
          "negative integer to remove that number of tokens from the cache instead.");
  }
  SUBCASE("crop on a layer that holds nothing is a no-op") {
    kvc::DynamicCache<float> c;
    c.crop(-3);
    CHECK(c.size() == 0);
    kvc::DynamicLayer::state<kvc::HostStorage<float>> layer{kvc::DynamicLayer{}};
    layer.crop(-3);
    layer.crop(0);
    CHECK(layer.get_seq_length() == 0);
    CHECK_FALSE(layer.is_initialized());
  }
  SUBCASE("appending after a crop overwrites the removed tokens") {
    auto c = fresh();
    c.crop(-40);
    const auto more = kvc_test::random_tensor<float>(2, 32, 2, 32, rng);
    const auto kv = c.update(more, more, 0);
    CHECK(kv.keys.extent(2) == 7);
    kvc::HostTensor<float> first5 =
        keys.slice(Eigen::array<Eigen::Index, 4>{0, 0, 0, 0}, Eigen::array<Eigen::Index, 4>{2, 32, 5, 32});
    CHECK(kvc_test::flatten(kv.keys) == kvc_test::slice_seq(kvc_test::cat(first5, more), 0, 7));
  }
}

TEST_CASE_TEMPLATE_DEFINE("DynamicLayer holds and returns exactly what it was given", T, dynamic_shapes) {
  // Under the sanitizers, float and double: the 16-bit types take the same paths, and the time goes
  // to this test's own concatenations (the g++ build runs all four, natively and under valgrind).
  if (kvc_test::sanitized && (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>)) return;
  std::mt19937 rng(7);
  for (const auto& shape : std::vector<std::array<int, 3>>{{1, 1, 1}, {3, 2, 8}, {2, 8, 64}, {1, 4, 128}}) {
    const int b = shape[0], h = shape[1], d = shape[2];  // named, not bound: clang 14 cannot capture bindings
    CAPTURE(b);
    CAPTURE(h);
    CAPTURE(d);
    kvc::DynamicCache<T> cache;
    kvc::HostTensor<T> all_k, all_v;
    for (int step = 0; step < 40; ++step) {
      const int q = step == 0 ? 17 : 1 + step % 3;
      const auto k = kvc_test::random_tensor<T>(b, h, q, d, rng);
      const auto v = kvc_test::random_tensor<T>(b, h, q, d, rng);
      const auto [kl, ko] = cache.get_mask_sizes(q, 0);
      const auto kv = cache.update(k, v, 0);
      all_k = step == 0 ? k : kvc_test::cat(all_k, k);
      all_v = step == 0 ? v : kvc_test::cat(all_v, v);
      REQUIRE(kv.keys.extent(2) == kl);
      REQUIRE(ko == 0);
      REQUIRE(kvc_test::flatten(kv.keys) == kvc_test::slice_seq(all_k, 0, all_k.dimension(2)));
      REQUIRE(kvc_test::flatten(kv.values) == kvc_test::slice_seq(all_v, 0, all_v.dimension(2)));
    }
    // A head is a zero-copy Eigen map of [seq, head_dim].
    const auto kv = cache.stored(0);
    const auto m = kv.keys.head(b - 1, h - 1);
    CHECK(m.rows() == all_k.dimension(2));
    CHECK(m.cols() == d);
    CHECK(static_cast<double>(m(3, d - 1)) == static_cast<double>(all_k(b - 1, h - 1, 3, d - 1)));
    CHECK(m.data() == &kv.keys(b - 1, h - 1, 0, 0));
  }
}
TEST_CASE_TEMPLATE_APPLY(dynamic_shapes, kvc_test::element_types);

TEST_CASE("views returned by update are zero-copy windows into the layer") {
  kvc::DynamicCache<float> cache;
  const auto first = cache.update(seq({1, 2, 3}), seq({1, 2, 3}), 0);
  const auto second = cache.stored(0);
  CHECK(first.keys.data() == second.keys.data());
  // Growth is geometric, by a quarter: 100 single-token appends after 3 tokens reallocate 9 times
  // (16 -> 20 -> 25 -> 31 -> 38 -> 47 -> 58 -> 72 -> 90 -> 112 slots).
  int reallocations = 0;
  const float* last = first.keys.data();
  for (int i = 0; i < 100; ++i) {
    const auto kv = cache.update(seq({float(i)}), seq({float(i)}), 0);
    if (kv.keys.data() != last) ++reallocations;
    last = kv.keys.data();
  }
  CHECK(reallocations == 9);
}

TEST_CASE("Eigen::TensorMap and TensorView inputs are accepted") {
  std::vector<float> raw{1, 2, 3, 4};
  Eigen::TensorMap<kvc::HostTensor<float>> map(raw.data(), 1, 1, 4, 1);
  Eigen::TensorMap<const kvc::HostTensor<float>> cmap(raw.data(), 1, 1, 4, 1);
  kvc::DynamicCache<float> cache;
  cache.update(map, cmap, 0);
  kvc::DynamicCache<float> other;
  const auto kv = other.update(cache.stored(0).keys, cache.stored(0).values, 0);
  CHECK(values_of(kv.keys) == V{1, 2, 3, 4});
}

TEST_CASE("a dynamic layer holds at most 1.25x the bytes of its tokens past its first allocation") {
  // Token by token and in prefill chunks: every length from 256 on, the buffers hold at most a
  // quarter more than the tokens (one float K and V of 4 values per token: 32 bytes).
  const std::int64_t per_token = 2 * 4 * static_cast<std::int64_t>(sizeof(float));
  for (const std::int64_t chunk : {1, 7, 100}) {
    CAPTURE(chunk);
    kvc::DynamicCache<float> cache;
    kvc::HostTensor<float> t(1, 1, chunk, 4);
    t.setConstant(1.f);
    const auto in = kvc::HostStorage<float>::input_view(t);
    double worst = 0;
    for (std::int64_t len = chunk; len <= 6000; len += chunk) {
      cache.update(in, in, 0);
      if (len >= 256)
        worst = std::max(worst, static_cast<double>(cache.bytes()) / static_cast<double>(len * per_token));
    }
    CHECK(worst <= 1.25);
    CHECK(worst > 1.0);  // (it does grow ahead of its tokens)
  }
}

TEST_CASE("a sliding layer's first token does not take twice the window") {
  const std::int64_t window = 4096, per_token = 2 * 4 * static_cast<std::int64_t>(sizeof(float));
  kvc::Cache<kvc::Layers<kvc::DynamicSlidingWindowLayer>> cache(kvc::DynamicSlidingWindowLayer{window});
  kvc::HostTensor<float> t(1, 1, 1, 4);
  t.setConstant(1.f);
  const auto in = kvc::HostStorage<float>::input_view(t);
  cache.update(in, in, 0);
  CHECK(cache.bytes() == 16 * per_token);  // the smallest buffer a dynamic layer makes
  // It grows by doubling to about twice the window, and stays there however long it runs.
  std::int64_t most = 0;
  for (int i = 1; i < 3 * window; ++i) {
    cache.update(in, in, 0);
    most = std::max(most, cache.bytes());
  }
  CHECK(most == 2 * window * per_token);
  CHECK(cache.bytes() == 2 * window * per_token);
}

TEST_CASE("reserve: room for n tokens ahead, so that appends up to n move nothing") {
  const std::int64_t per_token = 2 * 4 * static_cast<std::int64_t>(sizeof(float));
  kvc::HostTensor<float> t(1, 1, 1, 4);
  t.setConstant(1.f);
  const auto in = kvc::HostStorage<float>::input_view(t);
  // Before the first update (a replicated cache makes its layers then): the first update takes it.
  kvc::DynamicCache<float> cache;
  cache.reserve(1000);
  const float* first = cache.update(in, in, 0).keys.data();
  CHECK(cache.bytes() == 1000 * per_token);
  for (int i = 1; i < 1000; ++i) CHECK(cache.update(in, in, 0).keys.data() == first);
  CHECK(cache.update(in, in, 1).keys.data() != nullptr);  // a layer made after reserve has the room too
  CHECK(cache.bytes() == 2000 * per_token);
  // Past the reserve it grows as before; reserving less than it holds changes nothing.
  cache.update(in, in, 0);
  CHECK(cache.bytes() == (1250 + 1000) * per_token);
  cache.reserve(10);
  CHECK(cache.bytes() == (1250 + 1000) * per_token);
  // A layer with tokens moves to the reserved room now, keeping them.
  kvc::DynamicCache<float> grown;
  kvc::HostTensor<float> three(1, 1, 3, 4);
  three.setValues({{{{1, 2, 3, 4}, {5, 6, 7, 8}, {9, 10, 11, 12}}}});
  grown.update(three, three, 0);
  grown.reserve(300);
  CHECK(grown.bytes() == 300 * per_token);
  CHECK(values_of(grown.stored(0).keys) == V{1, 5, 9});
  CHECK(grown.get_seq_length(0) == 3);
  CHECK_THROWS_WITH_AS(grown.reserve(-1), "kvc::Cache::reserve: tokens must be 0 or more, got -1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(grown.reserve(kvc::max_extent + 1),
                       "kvc::Cache::reserve: tokens is 1099511627777, above kvc's limit of 1099511627776",
                       kvc::ValueError);
  CHECK(grown.bytes() == 300 * per_token);
  // Static layers have their room already: reserve leaves them as they are.
  kvc::ModelConfig c;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 1;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  c.hidden_size = 4;
  kvc::StaticCache<float> fixed(c, 64);
  const std::int64_t before = fixed.bytes();
  fixed.reserve(1000);
  CHECK(fixed.bytes() == before);
}
