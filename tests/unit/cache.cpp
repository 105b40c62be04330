// kvc::Cache's method set: lazy growth, index and shape errors, early_initialization, the
// whole-cache operations and their dispatch to layer kinds, and the properties (transformers'
// Cache, src/transformers/cache_utils.py at a597f974).

#include "../support/kvc_test.hpp"

using kvc_test::seq;
using kvc_test::values_of;
using V = std::vector<float>;
using mask = std::pair<std::int64_t, std::int64_t>;

namespace {
kvc::HostTensor<float> ones(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) {
  kvc::HostTensor<float> t(b, h, s, d);
  t.setConstant(1.f);
  return t;
}
using Mixed = kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>>;

// Two layers of one head of size 1: full attention, then a sliding window of 2.
kvc::ModelConfig full_then_sliding() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 1;
  c.head_dim = 1;
  c.sliding_window = 2;
  c.layer_types = std::vector<std::string>{"full_attention", "sliding_attention"};
  return c;
}
}  // namespace

TEST_CASE("a replicated cache grows lazily and fills skipped indices") {
  kvc::DynamicCache<float> cache;
  CHECK(cache.size() == 0);
  CHECK_FALSE(cache.is_compileable());
  CHECK_FALSE(cache.is_initialized());
  auto [k, v] = cache.update(seq({1, 2}), seq({3, 4}), 3);
  CHECK(values_of(k) == V{1, 2});
  CHECK(values_of(v) == V{3, 4});
  CHECK(cache.size() == 4);
  CHECK(cache.get_seq_length(3) == 2);
  CHECK(cache.get_seq_length(0) == 0);
  CHECK(cache.get_seq_length(7) == 0);
  CHECK(cache.layer_name(1) == "DynamicLayer");
  CHECK_FALSE(cache.is_initialized());  // layers 0-2 hold nothing yet
  for (std::int64_t i = 0; i < 3; ++i) cache.update(seq({1}), seq({1}), i);
  CHECK(cache.is_initialized());
  CHECK(cache.get_mask_sizes(5, 9) == mask{5, 0});
  CHECK(cache.get_max_length(9) == -1);
}

TEST_CASE("a replicated cache of another kind copies its prototype") {
  kvc::Cache<kvc::Replicate<kvc::StaticLayer>> cache(kvc::StaticLayer{3});
  cache.update(seq({1}), seq({1}), 1);
  CHECK(cache.size() == 2);
  CHECK(cache.get_max_length() == 3);
  CHECK(values_of(cache.stored(1).keys) == V{1, 0, 0});
  // A layer update that throws removes the layers the call appended.
  CHECK_THROWS_AS(cache.update(seq({1, 2, 3, 4}), seq({1, 2, 3, 4}), 4), kvc::IndexError);
  CHECK(cache.size() == 2);
  // A bad prototype is refused at construction.
  CHECK_THROWS_AS(kvc::Cache<kvc::Replicate<kvc::DynamicSlidingWindowLayer>>(), kvc::ValueError);
}

TEST_CASE("index errors") {
  kvc::DynamicCache<float> cache;
  const auto before = kvc_test::take_snapshot(cache);
  CHECK_THROWS_WITH_AS(cache.update(seq({1}), seq({1}), -1),
                       "update: layer_idx -1 is out of range: layer indices start at 0", kvc::IndexError);
  CHECK_THROWS_WITH_AS(cache.get_seq_length(-2),
                       "get_seq_length: layer_idx -2 is out of range: layer indices start at 0", kvc::IndexError);
  CHECK_THROWS_WITH_AS(cache.stored(0), "stored: layer_idx 0 is out of range for a Cache with 0 layers",
                       kvc::IndexError);
  CHECK(kvc_test::take_snapshot(cache) == before);
  Mixed mixed(kvc::DynamicLayer{}, kvc::StaticLayer{4});
  CHECK_THROWS_WITH_AS(mixed.update(seq({1}), seq({1}), 2),
                       "update: layer_idx 2 is out of range for a Cache with 2 layers", kvc::IndexError);
  CHECK_THROWS_WITH_AS(mixed.get_mask_sizes(-1, 0), "get_mask_sizes: query_length must be 0 or more, got -1",
                       kvc::ValueError);
}

TEST_CASE("shape errors name both shapes and change nothing") {
  kvc::DynamicCache<float> cache;
  cache.update(ones(1, 2, 3, 4), ones(1, 2, 3, 4), 0);
  const auto before = kvc_test::take_snapshot(cache);
  CHECK_THROWS_WITH_AS(cache.update(ones(1, 2, 3, 4), ones(1, 2, 5, 4), 0),
                       "update: keys of shape [1, 2, 3, 4] and values of shape [1, 2, 5, 4] must have the same batch, "
                       "heads and seq dimensions",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      cache.update(ones(2, 2, 1, 4), ones(2, 2, 1, 4), 0),
      "update: keys of shape [2, 2, 1, 4] and values of shape [2, 2, 1, 4] do not match layer 0, which "
      "holds batch 1, 2 heads, key head_dim 4 and value head_dim 4",
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      cache.update(ones(1, 2, 1, 8), ones(1, 2, 1, 4), 0),
      "update: keys of shape [1, 2, 1, 8] and values of shape [1, 2, 1, 4] do not match layer 0, which "
      "holds batch 1, 2 heads, key head_dim 4 and value head_dim 4",
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache.update(ones(1, 0, 1, 4), ones(1, 0, 1, 4), 5),
                       "update: keys of shape [1, 0, 1, 4] and values of shape [1, 0, 1, 4]: batch, heads and head_dim "
                       "must be positive",
                       kvc::ValueError);
  kvc::TensorView<float> strided = cache.stored(0).keys;
  strided.strides[3] = 2;
  const std::string stride_message =
      "update: keys and values must have contiguous [seq, head_dim] blocks, got strides [" +
      std::to_string(strided.strides[0]) + ", " + std::to_string(strided.strides[1]) + ", 4, 2]";
  CHECK_THROWS_WITH_AS(cache.update(strided, strided, 1), stride_message.c_str(), kvc::ValueError);
  CHECK(kvc_test::take_snapshot(cache) == before);
}

TEST_CASE("keys and values may have different head dims (MLA)") {
  kvc::StaticCache<float> cache(
      [] {
        kvc::ModelConfig c;
        c.num_hidden_layers = 1;
        c.num_attention_heads = 2;
        c.head_dim = 4;
        return c;
      }(),
      5);
  const auto kv = cache.update(ones(1, 2, 2, 4), ones(1, 2, 2, 6), 0);
  CHECK(kv.keys.extent(3) == 4);
  CHECK(kv.values.extent(3) == 6);
  CHECK(cache.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.shape(); })
      return l.shape();
    else
      return kvc::LayerShape{};
  }) == kvc::LayerShape{1, 2, 4, 6});
}

TEST_CASE("early_initialization: broadcast, per-layer lists and both length errors") {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.head_dim = 8;
  SUBCASE("length errors, verbatim, before anything changes") {
    kvc::StaticCache<float> cache(c, 6);
    const auto before = kvc_test::take_snapshot(cache);
    CHECK_THROWS_WITH_AS(cache.early_initialization(1, std::vector<std::int64_t>{1, 2, 3}, 8),
                         "`num_head` was provided as a list of length 3, but the Cache currently has 2 layers",
                         kvc::ValueError);
    CHECK_THROWS_WITH_AS(cache.early_initialization(1, 2, {8}),
                         "`head_dim` was provided as a list of length 1, but the Cache currently has 2 layers",
                         kvc::ValueError);
    CHECK_THROWS_WITH_AS(cache.early_initialization(0, 2, 8),
                         "early_initialization: batch_size must be a positive integer, got 0", kvc::ValueError);
    CHECK_THROWS_WITH_AS(cache.early_initialization(1, {2, 0}, 8),
                         "early_initialization: layer 1 needs a positive number of heads and head_dim, got num_heads 0 "
                         "and head_dim 8",
                         kvc::ValueError);
    CHECK(kvc_test::take_snapshot(cache) == before);
  }
  SUBCASE("per-layer lists allocate static layers with their own shapes") {
    kvc::StaticCache<float> cache(c, 6);
    cache.early_initialization(3, {4, 2}, {8, 16});
    CHECK(cache.is_initialized());
    CHECK(cache.batch_size() == 3);
    CHECK(cache.stored(0).keys.extents == std::array<std::int64_t, 4>{3, 4, 6, 8});
    CHECK(cache.stored(1).values.extents == std::array<std::int64_t, 4>{3, 2, 6, 16});
    CHECK(cache.get_seq_length(1) == 0);
    // Already initialized layers are left alone.
    cache.early_initialization(1, 1, 1);
    CHECK(cache.stored(0).keys.extents == std::array<std::int64_t, 4>{3, 4, 6, 8});
    CHECK_THROWS_AS(cache.update(ones(1, 4, 1, 8), ones(1, 4, 1, 8), 0), kvc::ValueError);
    cache.update(ones(3, 4, 1, 8), ones(3, 4, 1, 8), 0);
  }
  SUBCASE("dynamic layers fix their shape and allocate nothing") {
    auto cache = kvc::make_dynamic_cache<float>(c);
    cache.early_initialization(1, 4, 8);
    CHECK(cache.is_initialized());
    CHECK(cache.bytes() == 0);
    CHECK(cache.get_seq_length() == 0);
    CHECK_THROWS_AS(cache.update(ones(1, 2, 1, 8), ones(1, 2, 1, 8), 0), kvc::ValueError);
    CHECK(cache.update(ones(1, 4, 2, 8), ones(1, 4, 2, 8), 0).keys.extent(2) == 2);
  }
  SUBCASE("an empty replicated cache has no layers to initialize") {
    kvc::DynamicCache<float> cache;
    cache.early_initialization(1, 2, 3);
    CHECK(cache.size() == 0);
    CHECK_THROWS_WITH_AS(cache.early_initialization(1, {2}, 3),
                         "`num_head` was provided as a list of length 1, but the Cache currently has 0 layers",
                         kvc::ValueError);
  }
}

TEST_CASE("batch_size") {
  kvc::Cache<kvc::Layers<kvc::StaticLayer>> cache(kvc::StaticLayer{4}, kvc::StaticLayer{4});
  CHECK(cache.batch_size() == -1);
  cache.update(ones(1, 1, 1, 1), ones(1, 1, 1, 1), 0);
  CHECK(cache.batch_size() == 1);
  cache.update(ones(2, 1, 1, 1), ones(2, 1, 1, 1), 1);
  CHECK_THROWS_WITH_AS(cache.batch_size(), "The batch size is not consistent across layers: [1, 2]", kvc::ValueError);
  kvc::DynamicCache<float> dynamic;
  dynamic.update(ones(3, 1, 1, 1), ones(3, 1, 1, 1), 0);
  CHECK(dynamic.batch_size() == 3);  // transformers: -1 for every DynamicCache
}

TEST_CASE("get_max_length over the layers") {
  kvc::DynamicCache<float> empty;
  CHECK_THROWS_WITH_AS(empty.get_max_length(),
                       "`get_max_length` was called on a Cache that has no layers yet: a replicated Cache creates its "
                       "layers on the first `update` of each index",
                       kvc::ValueError);
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 1;
  c.head_dim = 1;
  c.sliding_window = 16;
  c.layer_types = std::vector<std::string>{"sliding_attention", "full_attention"};
  auto mixed = kvc::make_dynamic_cache<float>(c);
  CHECK(mixed.get_max_length() == -1);  // transformers reports 16 although layer 1 is unbounded
  CHECK(mixed.get_max_length(0) == 16);
  c.layer_types = std::vector<std::string>{"sliding_attention", "sliding_attention"};
  CHECK(kvc::make_dynamic_cache<float>(c).get_max_length() == 16);
}

TEST_CASE("operations a layer kind lacks: AttributeError at run time, before anything changes") {
  Mixed mixed(kvc::DynamicLayer{}, kvc::StaticLayer{4});
  mixed.update(ones(2, 1, 2, 1), ones(2, 1, 2, 1), 0);
  mixed.update(ones(2, 1, 2, 1), ones(2, 1, 2, 1), 1);
  const auto before = kvc_test::take_snapshot(mixed);
  CHECK_THROWS_WITH_AS(mixed.crop(-1), "'StaticLayer' object has no attribute 'crop'", kvc::AttributeError);
  CHECK_THROWS_WITH_AS(mixed.batch_repeat_interleave(2),
                       "'StaticLayer' object has no attribute 'batch_repeat_interleave'", kvc::AttributeError);
  CHECK_THROWS_WITH_AS(mixed.batch_select_indices({0}), "'StaticLayer' object has no attribute 'batch_select_indices'",
                       kvc::AttributeError);
  CHECK_THROWS_WITH_AS(mixed.set_write_position(0), "'DynamicLayer' object has no attribute 'set_write_position'",
                       kvc::AttributeError);
  CHECK(kvc_test::take_snapshot(mixed) == before);
  mixed.reorder_cache({1, 0});  // every kind has reorder_cache
  // A cache whose layers all have the operation runs it.
  Mixed dynamic_only(kvc::DynamicLayer{}, kvc::DynamicLayer{});
  dynamic_only.update(seq({1, 2, 3}), seq({1, 2, 3}), 0);
  dynamic_only.crop(-1);
  CHECK(dynamic_only.get_seq_length() == 2);
}

TEST_CASE("crop checks every layer before changing any") {
  auto cache = kvc::make_dynamic_cache<float>(full_then_sliding());
  cache.update(seq({1, 2, 3}), seq({1, 2, 3}), 0);
  cache.update(seq({1, 2, 3}), seq({1, 2, 3}), 1);
  const auto before = kvc_test::take_snapshot(cache);
  CHECK_THROWS_AS(cache.crop(-1), kvc::RuntimeError);
  CHECK(kvc_test::take_snapshot(cache) == before);
  cache.activate_past_recording();
  cache.update(seq({4}), seq({4}), 0);
  cache.update(seq({4}), seq({4}), 1);
  cache.crop(-1);
  CHECK(cache.get_seq_length(0) == 3);
  CHECK(cache.get_seq_length(1) == 3);
}

TEST_CASE("batch operation argument errors change nothing") {
  kvc::DynamicCache<float> cache;
  cache.update(ones(2, 1, 2, 1), ones(2, 1, 2, 1), 0);
  const auto before = kvc_test::take_snapshot(cache);
  CHECK_THROWS_WITH_AS(cache.reorder_cache({0, 2}),
                       "reorder_cache: index 2 is out of bounds for dimension 0 with size 2", kvc::IndexError);
  CHECK_THROWS_WITH_AS(cache.batch_select_indices({-1}),
                       "batch_select_indices: index -1 is out of bounds for dimension 0 with size 2", kvc::IndexError);
  CHECK_THROWS_WITH_AS(cache.batch_select_indices(std::span<const std::int64_t>{}),
                       "batch_select_indices: the batch cannot become empty", kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache.batch_repeat_interleave(0),
                       "batch_repeat_interleave: repeats must be a positive integer, got 0", kvc::ValueError);
  CHECK(kvc_test::take_snapshot(cache) == before);
}

TEST_CASE("reset empties dynamic layers and rewinds static ones") {
  Mixed mixed(kvc::DynamicLayer{}, kvc::StaticLayer{4});
  mixed.update(seq({1, 2}), seq({1, 2}), 0);
  mixed.update(seq({1, 2}), seq({1, 2}), 1);
  mixed.reset();
  CHECK(mixed.get_seq_length(0) == 0);
  CHECK(mixed.get_seq_length(1) == 0);
  CHECK(values_of(mixed.update(seq({7}), seq({7}), 0).keys) == V{7});
  CHECK(values_of(mixed.update(seq({7}), seq({7}), 1).keys) == V{7, 0, 0, 0});
}

TEST_CASE("activate_past_recording reaches the sliding layers only") {
  auto cache = kvc::make_dynamic_cache<float>(full_then_sliding());
  cache.activate_past_recording();
  CHECK(cache.visit_layer(1, [](const auto& l) {
    if constexpr (requires { l.records_past(); })
      return l.records_past();
    else
      return false;
  }));
  cache.update(seq({1, 2, 3, 4}), seq({1, 2, 3, 4}), 1);
  CHECK(cache.stored(1).keys.extent(2) == 4);
}

TEST_CASE("is_sliding, is_compileable and size of the ready-made caches") {
  kvc::ModelConfig c;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 1;
  c.head_dim = 1;
  c.sliding_window = 2;
  c.layer_types = std::vector<std::string>{"full_attention", "sliding_attention", "chunked_attention"};
  c.attention_chunk_size = 3;
  const auto dynamic = kvc::make_dynamic_cache<float>(c);
  const kvc::StaticCache<float> fixed(c, 8);
  CHECK(dynamic.size() == 3);
  CHECK(fixed.size() == 3);
  CHECK(dynamic.is_sliding() == std::vector<bool>{false, true, true});
  CHECK(dynamic.is_sliding(1));
  CHECK_FALSE(dynamic.is_sliding(0));
  CHECK_FALSE(dynamic.is_sliding(7));  // past the last layer
  CHECK_THROWS_WITH_AS(dynamic.is_sliding(-1), "is_sliding: layer_idx -1 is out of range: layer indices start at 0",
                       kvc::IndexError);
  CHECK(fixed.is_sliding() == std::vector<bool>{false, true, true});
  CHECK_FALSE(dynamic.is_compileable());
  CHECK(fixed.is_compileable());
  CHECK(fixed.get_max_length(2) == 3);
  CHECK(dynamic.get_max_length(2) == 3);
}
