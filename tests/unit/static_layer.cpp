// StaticLayer through kvc::StaticCache: transformers' StaticLayer (src/transformers/cache_utils.py
// at a597f974) and the scenarios of transformers' tests/utils/test_cache_utils.py
// (test_static_cache_out_of_bounds, test_static_cache, test_static_cache_mha_mqa_gqa).

#include "../support/kvc_test.hpp"

using kvc_test::seq;
using kvc_test::values_of;
using V = std::vector<float>;

namespace {
// Gemma2Config(num_hidden_layers=1, heads 1, kv heads 1, head_dim 1, hidden 1, sliding_window=4,
// attention_chunk_size=4, layer_types=["full_attention"]) of
// transformers' SyntheticCacheTest.
kvc::ModelConfig synthetic(std::vector<std::string> layer_types = {"full_attention"}) {
  kvc::ModelConfig c;
  c.num_hidden_layers = static_cast<std::int64_t>(layer_types.size());
  c.num_attention_heads = 1;
  c.num_key_value_heads = 1;
  c.head_dim = 1;
  c.hidden_size = 1;
  c.sliding_window = 4;
  c.attention_chunk_size = 4;
  c.layer_types = std::move(layer_types);
  return c;
}
}  // namespace

TEST_CASE("writing past max_cache_len is an IndexError that changes nothing (test_static_cache_out_of_bounds)") {
  kvc::StaticCache<float> cache(synthetic(), 4);
  cache.update(seq({1, 2, 3, 4}), seq({1, 2, 3, 4}), 0);
  const auto before = kvc_test::take_snapshot(cache);
  CHECK_THROWS_AS(cache.update(seq({1}), seq({1}), 0), kvc::IndexError);
  CHECK_THROWS_WITH(cache.update(seq({1}), seq({1}), 0),
                    "index 4 is out of bounds for dimension 2 with size 4: StaticLayer with max_cache_len 4 holds 4 "
                    "tokens and cannot take 1 more");
  CHECK(kvc_test::take_snapshot(cache) == before);
  CHECK(cache.get_seq_length() == 4);  // transformers has already advanced its counter to 5
}

TEST_CASE("a first update longer than the buffer leaves the layer uninitialized") {
  kvc::StaticCache<float> cache(synthetic(), 2);
  CHECK_THROWS_AS(cache.update(seq({1, 2, 3}), seq({1, 2, 3}), 0), kvc::IndexError);
  CHECK_FALSE(cache.is_initialized());
  CHECK(cache.bytes() == 0);
}

TEST_CASE("writes at the counter, zeros elsewhere (test_static_cache)") {
  kvc::StaticCache<float> cache(synthetic(), 4);
  cache.update(seq({1, 2}), seq({1, 2}), 0);
  auto kv = cache.update(seq({3}), seq({3}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{1, 2, 3, 0});  // StaticCache Scenario 1
  CHECK(values_of(kv.keys) == V{1, 2, 3, 0});
  CHECK(values_of(kv.values) == V{1, 2, 3, 0});
  kv = cache.update(seq({4}), seq({4}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{1, 2, 3, 4});  // StaticCache Scenario 2
  CHECK(cache.get_seq_length() == 4);
  CHECK(cache.get_mask_sizes(1, 0) == std::pair<std::int64_t, std::int64_t>{4, 0});
  CHECK(cache.get_max_length() == 4);
  CHECK(cache.is_compileable());
  CHECK(cache.is_sliding() == std::vector<bool>{false});
}

TEST_CASE("MHA, GQA and MQA shapes (test_static_cache_mha_mqa_gqa)") {
  std::mt19937 rng(1);
  for (const std::int64_t kv_heads : {32, 4, 1}) {
    kvc::ModelConfig llama;
    llama.num_hidden_layers = 1;
    llama.num_attention_heads = 32;
    llama.hidden_size = 4096;
    if (kv_heads != 32) llama.num_key_value_heads = kv_heads;
    kvc::StaticCache<float> cache(llama, 10);
    const auto d = llama.layer_head_dim(0);
    CHECK(d == 128);
    const auto kv = cache.update(kvc_test::random_tensor<float>(1, kv_heads, 1, d, rng),
                                 kvc_test::random_tensor<float>(1, kv_heads, 1, d, rng), 0);
    CHECK(kv.keys.extents == std::array<std::int64_t, 4>{1, kv_heads, 10, 128});
    CHECK(kv.values.extents == std::array<std::int64_t, 4>{1, kv_heads, 10, 128});
  }
}

TEST_CASE("get_max_length is max_cache_len") {
  kvc::ModelConfig c = synthetic({"full_attention", "full_attention"});
  kvc::StaticCache<float> cache(c, 8);
  CHECK(cache.get_max_length() == 8);
  CHECK(cache.get_max_length(1) == 8);
  CHECK(cache.get_max_length(2) == -1);
}

TEST_CASE("set_write_position moves the counter (the export path)") {
  kvc::StaticCache<float> cache(synthetic(), 4);
  cache.update(seq({1, 2, 3}), seq({1, 2, 3}), 0);
  cache.set_write_position(1);
  CHECK(cache.get_seq_length() == 1);
  cache.update(seq({9}), seq({9}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{1, 9, 3, 0});
  CHECK(cache.get_seq_length() == 2);
  const auto before = kvc_test::take_snapshot(cache);
  CHECK_THROWS_WITH_AS(cache.set_write_position(5),
                       "set_write_position: position 5 is out of range for a StaticLayer with max_cache_len 4",
                       kvc::IndexError);
  CHECK_THROWS_WITH_AS(cache.set_write_position(-1), "set_write_position: position -1 is negative", kvc::IndexError);
  CHECK(kvc_test::take_snapshot(cache) == before);
  cache.set_write_position(4);
  CHECK_THROWS_AS(cache.update(seq({1}), seq({1}), 0), kvc::IndexError);
}

TEST_CASE_TEMPLATE_DEFINE("a static layer never allocates after initialization", T, static_no_alloc) {
  std::mt19937 rng(5);
  kvc::ModelConfig c = synthetic({"full_attention", "full_attention"});
  kvc::StaticCache<T> cache(c, 64);
  cache.early_initialization(2, 4, 16);
  CHECK(cache.is_initialized());
  const auto bytes = cache.bytes();
  CHECK(bytes == 2 * 2 * (2 * 4 * 64 * 16) * std::int64_t(sizeof(T)));
  const T* k0 = cache.stored(0).keys.data();
  const T* v1 = cache.stored(1).values.data();
  kvc::HostTensor<T> history(2, 4, 0, 16);
  for (int step = 0; step < 40; ++step) {
    const std::int64_t q = 1 + step % 2;
    if (cache.get_seq_length(0) + q > 64) break;
    const auto k = kvc_test::random_tensor<T>(2, 4, q, 16, rng);
    history = kvc_test::cat(history, k);
    for (std::int64_t l = 0; l < 2; ++l) {
      const auto kv = cache.update(k, k, l);
      REQUIRE(kv.keys.extent(2) == 64);
    }
  }
  CHECK(cache.stored(0).keys.data() == k0);
  CHECK(cache.stored(1).values.data() == v1);
  CHECK(cache.bytes() == bytes);
  const auto n = history.dimension(2);
  CHECK(kvc_test::flatten(cache.stored(1).keys).size() == std::size_t(2 * 4 * 64 * 16));
  // The written prefix equals the history, the rest is zeros.
  const auto stored = cache.stored(1).keys;
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t s = 0; s < 64; ++s)
        for (std::int64_t d = 0; d < 16; ++d)
          REQUIRE(static_cast<double>(stored(b, h, s, d)) == (s < n ? static_cast<double>(history(b, h, s, d)) : 0.0));
  // reset zeroes in place and keeps the buffers.
  cache.reset();
  CHECK(cache.stored(0).keys.data() == k0);
  CHECK(cache.get_seq_length() == 0);
  CHECK(cache.is_initialized());
  for (double x : kvc_test::flatten(cache.stored(0).keys)) REQUIRE(x == 0.0);
}
TEST_CASE_TEMPLATE_APPLY(static_no_alloc, kvc_test::element_types);

TEST_CASE("reorder_cache on static layers picks beams") {
  kvc::StaticCache<float> cache(synthetic(), 3);
  kvc::HostTensor<float> t(2, 1, 2, 1);
  t.setValues({{{{1}, {2}}}, {{{3}, {4}}}});
  cache.update(t, t, 0);
  cache.reorder_cache({1, 1});
  CHECK(values_of(cache.stored(0).keys, 0) == V{3, 4, 0});
  CHECK(values_of(cache.stored(0).keys, 1) == V{3, 4, 0});
  CHECK(cache.get_seq_length() == 2);
}
