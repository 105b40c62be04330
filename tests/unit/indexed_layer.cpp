// DynamicIndexedLayer and StaticIndexedLayer: transformers' classes of the same names and
// Cache.update_indexer's ValueError (src/transformers/cache_utils.py at a597f974), the reset of
// transformers #48809 (test_dynamic_layers_reset_drops_their_states) and the CacheCroppingTests
// scenario with indexer keys of shape (2, 45, 32) (tests/utils/test_cache_utils.py).

#include <kvc/policies/layers/indexed.hpp>

#include "../support/kvc_test.hpp"

namespace {

using Idx = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using DynamicIndexedCache = kvc::Cache<kvc::Layers<kvc::DynamicIndexedLayer>>;
using StaticIndexedCache = kvc::Cache<kvc::Layers<kvc::StaticIndexedLayer>>;

Idx random_indexer(std::int64_t b, std::int64_t s, std::int64_t d, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-64, 64);
  Idx t(b, s, d);
  for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(dist(rng)) / 8.0f;
  return t;
}

// Every element of a [B, S, D] state view, in order.
std::vector<double> flat(const kvc::StateView<float>& v) {
  std::vector<double> out;
  for (std::int64_t i = 0; i < v.size(); ++i) out.push_back(v[i]);
  return out;
}

// t[:, from:from+len, :] flattened.
std::vector<double> slice(const Idx& t, std::int64_t from, std::int64_t len) {
  std::vector<double> out;
  for (std::int64_t b = 0; b < t.dimension(0); ++b)
    for (std::int64_t s = from; s < from + len; ++s)
      for (std::int64_t d = 0; d < t.dimension(2); ++d) out.push_back(t(b, s, d));
  return out;
}

// t[rows[i], :, :] stacked, then [:, :len, :].
std::vector<double> rows_of(const Idx& t, const std::vector<std::int64_t>& rows, std::int64_t len) {
  std::vector<double> out;
  for (const std::int64_t b : rows)
    for (std::int64_t s = 0; s < len; ++s)
      for (std::int64_t d = 0; d < t.dimension(2); ++d) out.push_back(t(b, s, d));
  return out;
}

std::array<std::int64_t, 3> shape3(const kvc::StateView<float>& v) {
  REQUIRE(v.rank == 3);
  return {v.extent(0), v.extent(1), v.extent(2)};
}

// transformers' CacheCroppingTests: attention (2, 32, 45, 32) and indexer (2, 45, 32), or batch 1.
struct scenario {
  std::mt19937 rng{43};
  std::int64_t batch;
  kvc::HostTensor<float> keys, values;
  Idx indexer;
  DynamicIndexedCache cache{kvc::DynamicIndexedLayer{}};

  explicit scenario(std::int64_t b) : batch(b) {
    keys = kvc_test::random_tensor<float>(b, 32, 45, 32, rng);
    values = kvc_test::random_tensor<float>(b, 32, 45, 32, rng);
    indexer = random_indexer(b, 45, 32, rng);
    cache.update(keys, values, 0);
    const auto got = cache.update_indexer(indexer, 0);
    REQUIRE(shape3(got) == std::array<std::int64_t, 3>{b, 45, 32});
    REQUIRE(flat(got) == slice(indexer, 0, 45));
  }
  kvc::StateView<float> indexer_keys() const {
    return cache.visit_layer(0, [](const auto& l) { return l.indexer_keys(); });
  }
};

}  // namespace

TEST_CASE("usage: a DSA layer stores keys, values and indexer keys") {
  std::mt19937 rng(2);
  const auto keys = kvc_test::random_tensor<float>(1, 2, 5, 8, rng);
  const auto values = kvc_test::random_tensor<float>(1, 2, 5, 8, rng);
  const Idx index_keys = random_indexer(1, 5, 16, rng);  // [batch, seq, index_head_dim]
  // [snippet:indexed]
  kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::DynamicIndexedLayer>> cache(kvc::DynamicLayer{},
                                                                             kvc::DynamicIndexedLayer{});
  auto [k, v] = cache.update(keys, values, 1);                      // [1, 2, 5, 8] each
  kvc::StateView<float> all = cache.update_indexer(index_keys, 1);  // [1, 5, 16]: every indexer key so far
  cache.crop(-2);                                                   // both parts of layer 1 drop 2 tokens
  // [/snippet]
  CHECK(k.extent(2) == 5);
  CHECK(v.extent(2) == 5);
  CHECK(shape3(all) == std::array<std::int64_t, 3>{1, 5, 16});
  CHECK(cache.get_seq_length(1) == 3);
  CHECK(cache.visit_layer(1, [](const auto& l) {
    if constexpr (requires { l.indexer_seq_length(); })
      return l.indexer_seq_length();
    else
      return std::int64_t{-1};
  }) == 3);
}

TEST_CASE("DynamicIndexedLayer: crop rules of CacheCroppingTests on keys and indexer keys, batch 2 and 1") {
  SUBCASE("crop(-3) drops the last 3 tokens of both (test_crop_with_past)") {
    for (const std::int64_t b : {2, 1}) {
      CAPTURE(b);
      scenario s(b);
      s.cache.crop(-3);
      CHECK(s.cache.get_seq_length() == 42);
      CHECK(kvc_test::flatten(s.cache.stored(0).keys) == kvc_test::slice_seq(s.keys, 0, 42));
      CHECK(kvc_test::flatten(s.cache.stored(0).values) == kvc_test::slice_seq(s.values, 0, 42));
      CHECK(shape3(s.indexer_keys()) == std::array<std::int64_t, 3>{b, 42, 32});
      CHECK(flat(s.indexer_keys()) == slice(s.indexer, 0, 42));
    }
  }
  SUBCASE("crop(0) changes nothing (test_crop_with_zero_still_shrink_states)") {
    for (const std::int64_t b : {2, 1}) {
      CAPTURE(b);
      scenario s(b);
      s.cache.crop(0);
      CHECK(s.cache.get_seq_length() == 45);
      CHECK(flat(s.indexer_keys()) == slice(s.indexer, 0, 45));
    }
  }
  SUBCASE("crop(-46) empties both (test_crop_outside_range)") {
    for (const std::int64_t b : {2, 1}) {
      CAPTURE(b);
      scenario s(b);
      s.cache.crop(-46);
      CHECK(s.cache.stored(0).keys.size() == 0);
      CHECK(s.cache.stored(0).values.size() == 0);
      CHECK(s.indexer_keys().size() == 0);
      CHECK(shape3(s.indexer_keys()) == std::array<std::int64_t, 3>{b, 0, 32});
      // and the layer keeps working
      std::mt19937 rng(5);
      const Idx more = random_indexer(b, 2, 32, rng);
      CHECK(flat(s.cache.update_indexer(more, 0)) == slice(more, 0, 2));
    }
  }
  SUBCASE("crop(42) keeps 42 tokens and warns (test_bc_crop_with_positive_value)") {
    for (const std::int64_t b : {2, 1}) {
      CAPTURE(b);
      kvc_test::captured_warnings w;
      scenario s(b);
      s.cache.crop(42);
      REQUIRE(!w.messages.empty());
      CHECK(w.messages.front().find("Calling `crop` with a positive value is deprecated and will be removed") == 0);
      CHECK(s.cache.get_seq_length() == 42);
      CHECK(kvc_test::flatten(s.cache.stored(0).keys) == kvc_test::slice_seq(s.keys, 0, 42));
      CHECK(flat(s.indexer_keys()) == slice(s.indexer, 0, 42));
    }
  }
  SUBCASE("crop(50), a positive value past the length, changes nothing") {
    for (const std::int64_t b : {2, 1}) {
      CAPTURE(b);
      scenario s(b);
      s.cache.crop(50);
      CHECK(s.cache.get_seq_length() == 45);
      CHECK(flat(s.indexer_keys()) == slice(s.indexer, 0, 45));
    }
  }
}

TEST_CASE("DynamicIndexedLayer: update_indexer appends and returns everything, for batch 1 and 3") {
  for (const std::int64_t b : {1, 3}) {
    CAPTURE(b);
    std::mt19937 rng(7);
    DynamicIndexedCache cache{kvc::DynamicIndexedLayer{}};
    Idx all(b, 0, 4);
    // chunks that cross the initial capacity (16) and its doublings, with a crop in between
    for (const std::int64_t q : {5, 1, 12, 1, 1, 20, 3, 0, 40}) {
      const Idx x = random_indexer(b, q, 4, rng);
      Idx next(b, all.dimension(1) + q, 4);
      for (std::int64_t i = 0; i < b; ++i)
        for (std::int64_t s = 0; s < next.dimension(1); ++s)
          for (std::int64_t d = 0; d < 4; ++d)
            next(i, s, d) = s < all.dimension(1) ? all(i, s, d) : x(i, s - all.dimension(1), d);
      all = next;
      const auto got = cache.update_indexer(x, 0);
      CHECK(shape3(got) == std::array<std::int64_t, 3>{b, all.dimension(1), 4});
      CHECK(flat(got) == slice(all, 0, all.dimension(1)));
      if (q == 20) {
        cache.crop(-7);
        Idx kept(b, all.dimension(1) - 7, 4);
        for (std::int64_t i = 0; i < kept.size(); ++i) kept.data()[i] = 0;
        for (std::int64_t i = 0; i < b; ++i)
          for (std::int64_t s = 0; s < kept.dimension(1); ++s)
            for (std::int64_t d = 0; d < 4; ++d) kept(i, s, d) = all(i, s, d);
        all = kept;
        const auto held = cache.visit_layer(0, [](const auto& l) { return l.indexer_keys(); });
        CHECK(flat(held) == slice(all, 0, all.dimension(1)));
      }
    }
    // the K/V part was never touched
    CHECK(cache.get_seq_length() == 0);
    CHECK_FALSE(cache.is_initialized());
    CHECK(cache.bytes() > 0);
  }
}

TEST_CASE("DynamicIndexedLayer: reorder_cache and the batch operations act on the indexer keys") {
  scenario s(2);
  s.cache.batch_repeat_interleave(2);  // rows 0, 0, 1, 1
  CHECK(shape3(s.indexer_keys()) == std::array<std::int64_t, 3>{4, 45, 32});
  CHECK(flat(s.indexer_keys()) == rows_of(s.indexer, {0, 0, 1, 1}, 45));
  CHECK(s.cache.batch_size() == 4);

  s.cache.reorder_cache({3, 0, 2, 1});  // rows 1, 0, 1, 0
  CHECK(flat(s.indexer_keys()) == rows_of(s.indexer, {1, 0, 1, 0}, 45));
  const auto k = s.cache.stored(0).keys;
  CHECK(k(0, 5, 7, 3) == s.keys(1, 5, 7, 3));
  CHECK(k(1, 5, 7, 3) == s.keys(0, 5, 7, 3));

  s.cache.batch_select_indices({2, 1});  // rows 1, 0
  CHECK(flat(s.indexer_keys()) == rows_of(s.indexer, {1, 0}, 45));
  CHECK(s.cache.stored(0).keys.extent(0) == 2);

  // appends after the batch operations continue every row
  std::mt19937 rng(11);
  const Idx x = random_indexer(2, 1, 32, rng);
  const auto got = s.cache.update_indexer(x, 0);
  CHECK(shape3(got) == std::array<std::int64_t, 3>{2, 46, 32});
  CHECK(got[45 * 32] == x(0, 0, 0));
  CHECK(got[(46 + 45) * 32 + 31] == x(1, 0, 31));
  CHECK(got[(46 + 3) * 32 + 2] == s.indexer(0, 3, 2));

  s.cache.batch_select_indices({1});  // batch 1: the fast path from here on
  const Idx y = random_indexer(1, 2, 32, rng);
  const auto one = s.cache.update_indexer(y, 0);
  CHECK(shape3(one) == std::array<std::int64_t, 3>{1, 48, 32});
  CHECK(one[3 * 32 + 2] == s.indexer(0, 3, 2));
  CHECK(one[47 * 32 + 5] == y(0, 1, 5));

  CHECK_THROWS_AS(s.cache.reorder_cache({1}), kvc::IndexError);
}

TEST_CASE("DynamicIndexedLayer: reset drops both parts (transformers #48809)") {
  std::mt19937 rng(13);
  DynamicIndexedCache cache{kvc::DynamicIndexedLayer{}};
  cache.update(kvc_test::random_tensor<float>(2, 4, 5, 16, rng), kvc_test::random_tensor<float>(2, 4, 5, 16, rng), 0);
  cache.update_indexer(random_indexer(2, 5, 8, rng), 0);
  cache.reset();
  CHECK(cache.get_seq_length() == 0);
  CHECK(cache.bytes() == 0);
  CHECK(cache.visit_layer(0, [](const auto& l) { return l.is_indexer_initialized(); }) == false);
  const auto kv = cache.update(kvc_test::random_tensor<float>(2, 4, 5, 16, rng),
                               kvc_test::random_tensor<float>(2, 4, 5, 16, rng), 0);
  CHECK(kv.keys.extent(2) == 5);
  // a different index_head_dim is fine after a reset: the layer starts afresh
  const auto idx = cache.update_indexer(random_indexer(2, 5, 4, rng), 0);
  CHECK(shape3(idx) == std::array<std::int64_t, 3>{2, 5, 4});
}

TEST_CASE("DynamicIndexedLayer: the K/V part behaves as a DynamicLayer") {
  DynamicIndexedCache cache{kvc::DynamicIndexedLayer{}};
  CHECK(cache.layer_name(0) == "DynamicIndexedLayer");
  CHECK(DynamicIndexedCache::can_crop);
  CHECK(DynamicIndexedCache::can_batch_ops);
  CHECK_FALSE(DynamicIndexedCache::can_set_write_position);
  cache.update(kvc_test::seq({1, 2}), kvc_test::seq({1, 2}), 0);
  const auto kv = cache.update(kvc_test::seq({3}), kvc_test::seq({3}), 0);
  CHECK(kvc_test::values_of(kv.keys) == std::vector<float>{1, 2, 3});
  CHECK(cache.get_seq_length() == 3);
  CHECK(cache.get_mask_sizes(2, 0) == std::pair<std::int64_t, std::int64_t>{5, 0});
  CHECK(cache.get_max_length() == -1);
  CHECK(cache.is_sliding() == std::vector<bool>{false});
  CHECK_FALSE(cache.is_compileable());
  // early_initialization fixes the K/V shape only
  DynamicIndexedCache early{kvc::DynamicIndexedLayer{}};
  early.early_initialization(2, 4, 8);
  CHECK(early.is_initialized());
  CHECK(early.batch_size() == 2);
}

TEST_CASE("indexer keys are checked: rank, batch and index_head_dim (ValueError, nothing changes)") {
  scenario s(2);
  const auto before = kvc_test::take_snapshot(s.cache);
  const auto held = flat(s.indexer_keys());
  std::mt19937 rng(3);

  Eigen::Tensor<float, 2, Eigen::RowMajor> flat2(2, 32);
  flat2.setZero();
  CHECK_THROWS_AS(s.cache.update_indexer(flat2, 0), kvc::ValueError);
  CHECK_THROWS_WITH(s.cache.update_indexer(flat2, 0),
                    "update_indexer: indexer keys must have shape [batch, seq, index_head_dim], got [2, 32]");

  const Idx wrong_batch = random_indexer(3, 1, 32, rng);
  CHECK_THROWS_AS(s.cache.update_indexer(wrong_batch, 0), kvc::ValueError);
  CHECK_THROWS_WITH(s.cache.update_indexer(wrong_batch, 0),
                    "update_indexer: indexer keys of shape [3, 1, 32] do not match the layer's keys of shape "
                    "[2, 32, 45, 32]: the batch sizes differ");

  const Idx wrong_dim = random_indexer(2, 1, 16, rng);
  CHECK_THROWS_AS(s.cache.update_indexer(wrong_dim, 0), kvc::ValueError);
  CHECK_THROWS_WITH(s.cache.update_indexer(wrong_dim, 0),
                    "update_indexer: indexer keys of shape [2, 1, 16] do not match the indexer keys the layer holds, "
                    "of shape [2, 45, 32]: batch and index_head_dim must stay the same");

  const Idx zero_dim(2, 1, 0);
  CHECK_THROWS_WITH_AS(s.cache.update_indexer(zero_dim, 0),
                       "update_indexer: indexer keys of shape [2, 1, 0] must have a positive batch and index_head_dim",
                       kvc::ValueError);

  CHECK(kvc_test::take_snapshot(s.cache) == before);
  CHECK(flat(s.indexer_keys()) == held);

  // Indexer keys first, then keys of another batch size: rejected by update.
  DynamicIndexedCache c{kvc::DynamicIndexedLayer{}};
  c.update_indexer(random_indexer(2, 3, 8, rng), 0);
  const auto k = kvc_test::random_tensor<float>(1, 2, 3, 4, rng);
  CHECK_THROWS_WITH_AS(c.update(k, k, 0),
                       "update: keys of shape [1, 2, 3, 4] do not match the layer's indexer keys of shape [2, 3, 8]: "
                       "the batch sizes differ",
                       kvc::ValueError);
  CHECK_FALSE(c.is_initialized());
  CHECK_THROWS_WITH_AS(c.early_initialization(1, 2, 4),
                       "lazy_initialization: batch size 1 does not match the layer's indexer keys, which have batch "
                       "size 2",
                       kvc::ValueError);
  CHECK_FALSE(c.is_initialized());
}

TEST_CASE("Cache::update_indexer on a layer without indexer keys is transformers' ValueError") {
  using Mixed = kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::DynamicIndexedLayer>>;
  Mixed cache(kvc::DynamicLayer{}, kvc::DynamicIndexedLayer{});
  std::mt19937 rng(1);
  const Idx x = random_indexer(1, 2, 8, rng);
  CHECK_THROWS_AS(cache.update_indexer(x, 0), kvc::ValueError);
  CHECK_THROWS_WITH(cache.update_indexer(x, 0),
                    "Cannot call `update_indexer` on layer 0 which is a DynamicLayer; it has no indexer key cache "
                    "(expected a `DynamicIndexedLayer` or `StaticIndexedLayer`).");
  CHECK(flat(cache.update_indexer(x, 1)) == slice(x, 0, 2));
  CHECK_THROWS_AS(cache.update_indexer(x, 2), kvc::IndexError);
}

// ---- StaticIndexedLayer --------------------------------------------------------------------

TEST_CASE("StaticIndexedLayer: writes at its own counter and returns the whole buffer") {
  std::mt19937 rng(17);
  StaticIndexedCache cache{kvc::StaticIndexedLayer{50}};
  CHECK(cache.layer_name(0) == "StaticIndexedLayer");
  CHECK(cache.is_compileable());
  CHECK_FALSE(StaticIndexedCache::can_crop);
  CHECK_FALSE(StaticIndexedCache::can_batch_ops);
  CHECK(StaticIndexedCache::can_set_write_position);

  const auto keys = kvc_test::random_tensor<float>(2, 32, 45, 32, rng);
  const auto kv = cache.update(keys, keys, 0);
  CHECK(kv.keys.extent(2) == 50);
  const Idx first = random_indexer(2, 45, 32, rng);
  auto got = cache.update_indexer(first, 0);
  CHECK(shape3(got) == std::array<std::int64_t, 3>{2, 50, 32});
  for (std::int64_t b = 0; b < 2; ++b) {
    CHECK(got[(b * 50 + 44) * 32 + 31] == first(b, 44, 31));
    CHECK(got[(b * 50 + 45) * 32] == 0.0f);  // unwritten slots are zeros
  }
  const Idx second = random_indexer(2, 5, 32, rng);
  got = cache.update_indexer(second, 0);
  CHECK(got[(1 * 50 + 49) * 32 + 7] == second(1, 4, 7));
  CHECK(got[(1 * 50 + 3) * 32 + 7] == first(1, 3, 7));
  CHECK(cache.visit_layer(0, [](const auto& l) { return l.indexer_seq_length(); }) == 50);
  CHECK(cache.get_seq_length() == 45);  // the K/V counter is separate

  SUBCASE("past max_cache_len: IndexError, nothing changes") {
    const auto before = kvc_test::take_snapshot(cache);
    const auto held = flat(cache.visit_layer(0, [](const auto& l) { return l.indexer_keys(); }));
    const Idx one = random_indexer(2, 1, 32, rng);
    CHECK_THROWS_AS(cache.update_indexer(one, 0), kvc::IndexError);
    CHECK_THROWS_WITH(cache.update_indexer(one, 0),
                      "index 50 is out of bounds for dimension 1 with size 50: StaticIndexedLayer with max_cache_len "
                      "50 holds 50 indexer keys and cannot take 1 more");
    CHECK(kvc_test::take_snapshot(cache) == before);
    CHECK(flat(cache.visit_layer(0, [](const auto& l) { return l.indexer_keys(); })) == held);
    CHECK(cache.visit_layer(0, [](const auto& l) { return l.indexer_seq_length(); }) == 50);
  }
  SUBCASE("reset zeroes both parts in place and rewinds both counters") {
    const auto bytes = cache.bytes();
    cache.reset();
    CHECK(cache.bytes() == bytes);
    CHECK(cache.get_seq_length() == 0);
    const auto held = cache.visit_layer(0, [](const auto& l) { return l.indexer_keys(); });
    CHECK(shape3(held) == std::array<std::int64_t, 3>{2, 50, 32});
    for (std::int64_t i = 0; i < held.size(); ++i) REQUIRE(held[i] == 0.0f);
    got = cache.update_indexer(second, 0);
    CHECK(got[(1 * 50 + 4) * 32 + 7] == second(1, 4, 7));
    CHECK(cache.visit_layer(0, [](const auto& l) { return l.indexer_seq_length(); }) == 5);
  }
  SUBCASE("set_write_position moves both counters") {
    cache.set_write_position(10);
    CHECK(cache.get_seq_length() == 10);
    CHECK(cache.visit_layer(0, [](const auto& l) { return l.indexer_seq_length(); }) == 10);
    got = cache.update_indexer(second, 0);
    CHECK(got[(0 * 50 + 10) * 32 + 1] == second(0, 0, 1));
    CHECK_THROWS_AS(cache.set_write_position(51), kvc::IndexError);
    CHECK(cache.visit_layer(0, [](const auto& l) { return l.indexer_seq_length(); }) == 15);
  }
  SUBCASE("reorder_cache gathers the indexer rows too") {
    cache.reorder_cache({1, 1});
    const auto held = cache.visit_layer(0, [](const auto& l) { return l.indexer_keys(); });
    CHECK(held[(0 * 50 + 3) * 32 + 7] == first(1, 3, 7));
    CHECK(held[(1 * 50 + 49) * 32 + 7] == second(1, 4, 7));
    CHECK(cache.stored(0).keys(0, 2, 3, 4) == keys(1, 2, 3, 4));
  }
}

TEST_CASE("StaticIndexedLayer: a first write longer than the buffer leaves it unallocated") {
  std::mt19937 rng(19);
  StaticIndexedCache cache{kvc::StaticIndexedLayer{4}};
  CHECK_THROWS_AS(cache.update_indexer(random_indexer(1, 5, 8, rng), 0), kvc::IndexError);
  CHECK(cache.bytes() == 0);
  CHECK(cache.visit_layer(0, [](const auto& l) { return l.is_indexer_initialized(); }) == false);
  CHECK_THROWS_WITH_AS(StaticIndexedCache(kvc::StaticIndexedLayer{0}),
                       "StaticIndexedLayer: max_cache_len must be a positive integer, got 0", kvc::ValueError);
}

TEST_CASE("StaticIndexedLayer: the same input checks as the dynamic kind") {
  std::mt19937 rng(23);
  StaticIndexedCache cache{kvc::StaticIndexedLayer{8}};
  cache.update_indexer(random_indexer(2, 3, 8, rng), 0);
  CHECK_THROWS_WITH_AS(cache.update_indexer(random_indexer(2, 1, 4, rng), 0),
                       "update_indexer: indexer keys of shape [2, 1, 4] do not match the indexer keys the layer "
                       "holds, of shape [2, 8, 8]: batch and index_head_dim must stay the same",
                       kvc::ValueError);
  const auto k = kvc_test::random_tensor<float>(3, 1, 1, 4, rng);
  CHECK_THROWS_AS(cache.update(k, k, 0), kvc::ValueError);
  CHECK_FALSE(cache.is_initialized());
  cache.early_initialization(2, 1, 4);
  CHECK(cache.is_initialized());
  CHECK(cache.bytes() == static_cast<std::int64_t>(sizeof(float)) * (2 * 8 * 8 + 2 * 2 * 1 * 8 * 4));
}
