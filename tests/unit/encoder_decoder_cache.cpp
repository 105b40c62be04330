// kvc::EncoderDecoderCache and kvc::cache_repr: transformers' EncoderDecoderCache
// (src/transformers/cache_utils.py at a597f974) and the errors of its __init__ (the TypeError for
// an argument that is not a Cache is the compile-fail test encoder_decoder_not_a_cache; the
// ValueError for another argument count has no counterpart in a typed API) and of
// check_dynamic_cache; docs/differences.md items 32-34.

#include <kvc/encoder_decoder_cache.hpp>
#include <kvc/speculative_caches.hpp>

#include "../support/kvc_test.hpp"

using kvc_test::seq;
using kvc_test::values_of;
using V = std::vector<float>;

namespace {

using Dyn = kvc::DynamicCache<float>;
using EDC = kvc::EncoderDecoderCache<Dyn, Dyn>;

kvc::ModelConfig two_full_layers() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 1;
  c.num_key_value_heads = 1;
  c.head_dim = 1;
  c.hidden_size = 1;
  c.layer_types = std::vector<std::string>{"full_attention", "full_attention"};
  return c;
}

// A [batch, 1, S, 1] tensor whose row b holds values + 100 * b.
kvc::HostTensor<float> rows(std::int64_t batch, const std::vector<float>& values) {
  kvc::HostTensor<float> t(batch, 1, static_cast<Eigen::Index>(values.size()), 1);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::size_t s = 0; s < values.size(); ++s)
      t(b, 0, static_cast<Eigen::Index>(s), 0) = values[s] + 100.0f * static_cast<float>(b);
  return t;
}

// An encoder-decoder pair of batch `batch`: self layers hold 3 tokens, cross layers 5.
EDC filled(std::int64_t batch) {
  Dyn self, cross;
  for (std::int64_t i = 0; i < 2; ++i) {
    self.update(rows(batch, {1, 2, 3}), rows(batch, {1, 2, 3}), i);
    cross.update(rows(batch, {10, 20, 30, 40, 50}), rows(batch, {10, 20, 30, 40, 50}), i);
  }
  return EDC(std::move(self), std::move(cross));
}

}  // namespace

TEST_CASE("construction: is_updated records which cross-attention layers hold tokens") {
  // [snippet:encoder_decoder]
  kvc::DynamicCache<float> self_attention, cross_attention;
  cross_attention.update(seq({7, 8, 9}), seq({7, 8, 9}), 1);  // layer 0 exists but holds nothing
  kvc::EncoderDecoderCache cache(std::move(self_attention), std::move(cross_attention));
  // is_updated: {0: false, 1: true}

  // A decoder layer: self-attention appends, cross-attention is filled once.
  const std::int64_t layer = 0;
  auto [k, v] = cache.self_attention_cache().update(seq({1, 2}), seq({1, 2}), layer);
  if (!cache.is_updated(layer)) {
    cache.cross_attention_cache().update(seq({4, 5, 6}), seq({4, 5, 6}), layer);
    cache.set_is_updated(layer);  // transformers: is_updated[layer_idx] = True
  }
  // [/snippet]
  CHECK(values_of(k) == V{1, 2});
  CHECK(values_of(v) == V{1, 2});
  CHECK(cache.is_updated() == std::map<std::int64_t, bool>{{0, true}, {1, true}});
  CHECK(cache.is_updated(0));
  CHECK_FALSE(cache.is_updated(7));  // never recorded: dict.get gives None
  cache.set_is_updated(7, false);
  CHECK(cache.is_updated().size() == 3);
  CHECK_THROWS_WITH_AS(cache.set_is_updated(-1),
                       "set_is_updated: layer_idx -1 is out of range: layer indices start at 0", kvc::IndexError);

  const auto fresh = EDC();
  CHECK(fresh.size() == 0);
  CHECK(fresh.is_updated().empty());
  CHECK(std::is_same_v<decltype(cache), EDC>);
}

TEST_CASE("length queries come from the self-attention cache") {
  EDC cache = filled(1);
  CHECK(cache.size() == 2);
  CHECK(cache.get_seq_length() == 3);
  CHECK(cache.get_seq_length(1) == 3);
  CHECK(cache.get_seq_length(5) == 0);
  CHECK(cache.get_query_offset() == 3);
  CHECK(cache.get_mask_sizes(2, 0) == std::pair<std::int64_t, std::int64_t>{5, 0});
  CHECK(cache.get_max_length() == -1);
  CHECK(cache.get_max_length(0) == -1);
  CHECK(cache.is_sliding() == std::vector<bool>{false, false});
  CHECK_FALSE(cache.is_sliding(0));
  CHECK_FALSE(cache.is_compileable());
  CHECK(cache.cross_attention_cache().get_seq_length() == 5);

  // activate_past_recording reaches the self-attention cache only
  kvc::ModelConfig config = two_full_layers();
  config.sliding_window = 4;
  config.layer_types = std::vector<std::string>{"sliding_attention", "full_attention"};
  kvc::EncoderDecoderCache pair(kvc::make_dynamic_cache<float>(config), kvc::make_dynamic_cache<float>(config));
  pair.activate_past_recording();
  const auto records = [](const auto& c) {
    return c.visit_layer(0, [](const auto& l) {
      if constexpr (requires { l.records_past(); })
        return l.records_past();
      else
        return false;
    });
  };
  CHECK(records(pair.self_attention_cache()));
  CHECK_FALSE(records(pair.cross_attention_cache()));
  CHECK(pair.is_sliding() == std::vector<bool>{true, false});
  CHECK(pair.get_max_length(0) == 4);
}

TEST_CASE("reset resets both caches and every is_updated entry") {
  EDC cache = filled(2);
  CHECK(cache.is_updated() == std::map<std::int64_t, bool>{{0, true}, {1, true}});
  cache.reset();
  CHECK(cache.get_seq_length() == 0);
  CHECK(cache.cross_attention_cache().get_seq_length() == 0);
  CHECK(cache.cross_attention_cache().get_seq_length(1) == 0);
  CHECK(cache.is_updated() == std::map<std::int64_t, bool>{{0, false}, {1, false}});
}

TEST_CASE("reorder_cache acts on both caches") {
  EDC cache = filled(3);
  cache.reorder_cache({2, 0, 0});
  for (const auto* c : {&cache.self_attention_cache(), &cache.cross_attention_cache()}) {
    const auto k = c->stored(1).keys;
    REQUIRE(k.extent(0) == 3);
    CHECK(k(0, 0, 0, 0) == 201.0f + 9.0f * static_cast<float>(c == &cache.cross_attention_cache()));
    CHECK(k(1, 0, 0, 0) == k(2, 0, 0, 0));
  }
  CHECK(values_of(cache.self_attention_cache().stored(0).keys, 0) == V{201, 202, 203});
  CHECK(values_of(cache.cross_attention_cache().stored(0).values, 1) == V{10, 20, 30, 40, 50});
}

TEST_CASE("crop acts on the self-attention cache only (EncoderDecoderCache.crop)") {
  EDC cache = filled(1);
  cache.crop(-2);
  CHECK(cache.get_seq_length() == 1);
  CHECK(values_of(cache.self_attention_cache().stored(1).keys) == V{1});
  CHECK(cache.cross_attention_cache().get_seq_length() == 5);
  CHECK(cache.cross_attention_cache().get_seq_length(1) == 5);
}

TEST_CASE("batch_repeat_interleave and batch_select_indices act on both caches") {
  EDC cache = filled(2);
  cache.batch_repeat_interleave(2);
  for (const auto* c : {&cache.self_attention_cache(), &cache.cross_attention_cache()}) {
    const auto k = c->stored(0).keys;
    REQUIRE(k.extent(0) == 4);
    CHECK(k(1, 0, 0, 0) == k(0, 0, 0, 0));
    CHECK(k(2, 0, 0, 0) == k(0, 0, 0, 0) + 100.0f);
  }
  cache.batch_select_indices({3});
  CHECK(values_of(cache.self_attention_cache().stored(0).keys) == V{101, 102, 103});
  CHECK(values_of(cache.cross_attention_cache().stored(1).keys) == V{110, 120, 130, 140, 150});
  CHECK(cache.self_attention_cache().batch_size() == 1);
  CHECK(cache.cross_attention_cache().batch_size() == 1);
}

TEST_CASE("an operation that fails on one cache leaves both unchanged") {
  // The self-attention cache holds batch 3, the cross-attention cache batch 2: index 2 is valid
  // for the first only. Both orders, so that either cache is the one copied.
  for (const bool self_smaller : {true, false}) {
    CAPTURE(self_smaller);
    Dyn self, cross;
    self.update(rows(3, {1, 2}), rows(3, {1, 2}), 0);
    // a DynamicLayer holds at least 16 slots: 30 tokens make the cross cache the larger one
    const V tokens = self_smaller ? V(30, 1.0f) : V{1};
    cross.update(rows(2, tokens), rows(2, tokens), 0);
    EDC cache(std::move(self), std::move(cross));
    CHECK((cache.self_attention_cache().bytes() < cache.cross_attention_cache().bytes()) == self_smaller);
    const auto self_before = kvc_test::take_snapshot(cache.self_attention_cache());
    const auto cross_before = kvc_test::take_snapshot(cache.cross_attention_cache());
    CHECK_THROWS_AS(cache.reorder_cache({2, 0}), kvc::IndexError);
    CHECK_THROWS_AS(cache.batch_select_indices({2}), kvc::IndexError);
    CHECK_THROWS_AS(cache.batch_repeat_interleave(0), kvc::ValueError);
    CHECK(kvc_test::take_snapshot(cache.self_attention_cache()) == self_before);
    CHECK(kvc_test::take_snapshot(cache.cross_attention_cache()) == cross_before);
  }
}

TEST_CASE("crop and the batch operations need two dynamic caches: transformers' TypeError (check_dynamic_cache)") {
  kvc::StaticCache<float> fixed(two_full_layers(), 8);
  fixed.update(seq({1, 2}), seq({1, 2}), 0);
  Dyn dynamic;
  dynamic.update(seq({1, 2, 3}), seq({1, 2, 3}), 0);
  kvc::EncoderDecoderCache cache(dynamic, fixed);
  static_assert(!decltype(cache)::is_dynamic);
  const auto self_before = kvc_test::take_snapshot(cache.self_attention_cache());

  CHECK_THROWS_WITH_AS(cache.crop(-1),
                       "`crop` is only defined for dynamic cache, got DynamicCache(layers=[DynamicLayer]) for the self "
                       "attention cache and StaticCache(layers=[StaticLayer, StaticLayer]) for the cross attention "
                       "cache.",
                       kvc::TypeError);
  CHECK_THROWS_WITH_AS(cache.batch_repeat_interleave(2),
                       "`batch_repeat_interleave` is only defined for dynamic cache, got "
                       "DynamicCache(layers=[DynamicLayer]) for the self attention cache and "
                       "StaticCache(layers=[StaticLayer, StaticLayer]) for the cross attention cache.",
                       kvc::TypeError);
  CHECK_THROWS_WITH_AS(cache.batch_select_indices({0}),
                       "`batch_select_indices` is only defined for dynamic cache, got "
                       "DynamicCache(layers=[DynamicLayer]) for the self attention cache and "
                       "StaticCache(layers=[StaticLayer, StaticLayer]) for the cross attention cache.",
                       kvc::TypeError);
  CHECK(kvc_test::take_snapshot(cache.self_attention_cache()) == self_before);

  // reorder_cache and reset are defined for every cache
  cache.reorder_cache({0});
  CHECK(cache.is_updated() == std::map<std::int64_t, bool>{{0, true}, {1, false}});
  cache.reset();
  CHECK(cache.cross_attention_cache().get_seq_length() == 0);

  // a cache mixing dynamic and static layers prints as `Cache`
  using Mixed = kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>>;
  kvc::EncoderDecoderCache mixed(Mixed(kvc::DynamicLayer{}, kvc::StaticLayer{4}), Dyn());
  CHECK_THROWS_WITH_AS(mixed.crop(0),
                       "`crop` is only defined for dynamic cache, got Cache(layers=[DynamicLayer, StaticLayer]) for "
                       "the self attention cache and DynamicCache(layers=[]) for the cross attention cache.",
                       kvc::TypeError);
}

TEST_CASE("cache_repr prints transformers' repr") {
  Dyn dynamic;
  CHECK(kvc::cache_repr(dynamic) == "DynamicCache(layers=[])");
  dynamic.update(seq({1}), seq({1}), 1);
  CHECK(kvc::cache_repr(dynamic) == "DynamicCache(layers=[DynamicLayer, DynamicLayer])");
  kvc::ModelConfig config = two_full_layers();
  config.sliding_window = 4;
  config.layer_types = std::vector<std::string>{"full_attention", "sliding_attention"};
  CHECK(kvc::cache_repr(kvc::make_dynamic_cache<float>(config)) ==
        "DynamicCache(layers=[DynamicLayer, DynamicSlidingWindowLayer])");
  CHECK(kvc::cache_repr(kvc::StaticCache<float>(config, 8)) ==
        "StaticCache(layers=[StaticLayer, StaticSlidingWindowLayer])");
  // transformers' Cache(layers=[...]) prints as Cache, whatever its layers (kvc used to name a cache of
  // only static or only dynamic kinds after StaticCache / DynamicCache).
  CHECK(kvc::cache_repr(kvc::Cache<kvc::Layers<kvc::StaticLayer>>(kvc::StaticLayer{3})) ==
        "Cache(layers=[StaticLayer])");
  CHECK(kvc::cache_repr(kvc::Cache<kvc::Layers<kvc::DynamicLayer>>(kvc::DynamicLayer{})) ==
        "Cache(layers=[DynamicLayer])");
  CHECK(kvc::cache_repr(kvc::QuantizedCache<float>("quanto", two_full_layers())) ==
        "QuantizedCache(layers=[QuantoQuantizedLayer, QuantoQuantizedLayer])");
  kvc::MtpCache<float> mtp;
  mtp.update(seq({1}), seq({1}), 0);
  CHECK(kvc::cache_repr(mtp) == "MtpCache(layers=[DynamicLayer])");
  CHECK(kvc::cache_repr(kvc::DFlashCache<double>()) == "DFlashCache(layers=[])");
  CHECK(kvc::cache_repr(kvc::EncoderDecoderCache(mtp, Dyn())) ==
        "EncoderDecoderCache(self_attention_cache=MtpCache(layers=[DynamicLayer]), "
        "cross_attention_cache=DynamicCache(layers=[]))");
}

TEST_CASE("which caches count as dynamic (transformers' isinstance(cache, DynamicCache))") {
  CHECK(kvc::EncoderDecoderCache<Dyn, Dyn>::is_dynamic);
  CHECK(kvc::EncoderDecoderCache<kvc::MtpCache<float>, kvc::DFlashCache<float>>::is_dynamic);
  CHECK(kvc::EncoderDecoderCache<kvc::ConfiguredDynamicCache<float>, Dyn>::is_dynamic);
  CHECK_FALSE(kvc::EncoderDecoderCache<Dyn, kvc::StaticCache<float>>::is_dynamic);
  CHECK_FALSE(kvc::EncoderDecoderCache<kvc::StaticCache<float>, Dyn>::is_dynamic);
  CHECK(kvc::detail::is_cache_v<kvc::Cache<kvc::Layers<kvc::StaticLayer>>>);
  CHECK_FALSE(kvc::detail::is_cache_v<int>);
  CHECK_FALSE(kvc::detail::is_cache_v<const Dyn>);
  CHECK_FALSE(kvc::detail::is_cache_v<Dyn&>);
  CHECK_FALSE(kvc::detail::is_cache_v<std::vector<float>>);
}

TEST_CASE("an MtpCache as the self-attention cache keeps its shifted mask sizes") {
  kvc::MtpCache<float> mtp;
  mtp.update(seq({1, 2, 3}), seq({1, 2, 3}), 0);
  mtp.update(seq({1, 2, 3}), seq({1, 2, 3}), 1);
  kvc::EncoderDecoderCache cache(std::move(mtp), Dyn());
  CHECK(cache.get_mask_sizes(1, 1) == std::pair<std::int64_t, std::int64_t>{4, 2});
  CHECK(cache.get_query_offset(1) == 5);
  cache.crop(-1);
  CHECK(cache.get_seq_length(1) == 2);
}

// ---- from per-layer tensors (transformers' one-argument form) --------------------------------

TEST_CASE("from per-layer 4-tuples (self_k, self_v, cross_k, cross_v)") {
  static_assert(EDC::constructible_from_data);
  static_assert(!kvc::EncoderDecoderCache<Dyn, kvc::StaticCache<float>>::constructible_from_data);
  const std::vector<std::vector<kvc::HostTensor<float>>> data{
      {seq({1, 2}), seq({3, 4}), seq({5, 6, 7}), seq({8, 9, 10})},
      {seq({11}), seq({12}), kvc::HostTensor<float>(1, 1, 0, 1), kvc::HostTensor<float>(1, 1, 0, 1)},
  };
  EDC cache(data);
  CHECK(cache.size() == 2);
  CHECK(values_of(cache.self_attention_cache().stored(0).keys) == V{1, 2});
  CHECK(values_of(cache.self_attention_cache().stored(0).values) == V{3, 4});
  CHECK(values_of(cache.cross_attention_cache().stored(0).keys) == V{5, 6, 7});
  CHECK(values_of(cache.cross_attention_cache().stored(0).values) == V{8, 9, 10});
  CHECK(values_of(cache.self_attention_cache().stored(1).keys) == V{11});
  CHECK(cache.is_updated() == std::map<std::int64_t, bool>{{0, true}, {1, false}});
}

TEST_CASE("from per-layer 6-tuples with sliding-window tensors") {
  using Configured = kvc::ConfiguredDynamicCache<float>;
  using Pair = kvc::EncoderDecoderCache<Configured, Configured>;
  static_assert(Pair::constructible_from_data);
  const kvc::HostTensor<float> none(0, 0, 0, 0);
  const std::vector<std::vector<kvc::HostTensor<float>>> data{
      {seq({1, 2}), seq({1, 2}), seq({4}), seq({5}), seq({5}), none},
      {seq({3}), seq({3}), none, seq({6}), seq({6}), none},
  };
  Pair cache(data);
  CHECK(cache.self_attention_cache().layer_name(0) == "DynamicSlidingWindowLayer");
  CHECK(cache.get_max_length(0) == 4);
  CHECK(cache.self_attention_cache().layer_name(1) == "DynamicLayer");
  CHECK(cache.cross_attention_cache().layer_name(0) == "DynamicLayer");
  CHECK(values_of(cache.cross_attention_cache().stored(1).keys) == V{6});
  CHECK(cache.is_sliding() == std::vector<bool>{true, false});

  // kvc::DynamicCache replicates DynamicLayer: a window is an error
  CHECK_THROWS_WITH_AS(EDC{data},
                       "EncoderDecoderCache: layer 0 has a sliding window, but DynamicCache replicates DynamicLayer; "
                       "use a cache with DynamicSlidingWindowLayer, such as kvc::ConfiguredDynamicCache",
                       kvc::ValueError);
  // ... but an empty window tensor stands for None
  const std::vector<std::vector<kvc::HostTensor<float>>> unwindowed{
      {seq({1}), seq({1}), none, seq({2}), seq({2}), none}};
  CHECK(EDC(unwindowed).get_seq_length() == 1);
}

TEST_CASE("an entry of another length is transformers' ValueError (EncoderDecoderCache.__init__)") {
  const std::vector<std::vector<kvc::HostTensor<float>>> five{
      {seq({1, 2}), seq({1, 2}), seq({1, 2}), seq({1, 2}), seq({1, 2})}};
  CHECK_THROWS_AS(EDC{five}, kvc::ValueError);
  CHECK_THROWS_WITH(EDC{five},
                    "Expected len(combined_cache_data) = 5 to be 4 or 6.\ncombined_cache_data = (tensor of shape "
                    "[1, 1, 2, 1], tensor of shape [1, 1, 2, 1], tensor of shape [1, 1, 2, 1], tensor of shape "
                    "[1, 1, 2, 1], tensor of shape [1, 1, 2, 1])");
  const std::vector<std::vector<kvc::HostTensor<float>>> one{{seq({1, 2}), seq({1, 2}), seq({1, 2}), seq({1, 2})},
                                                             {seq({3})}};
  CHECK_THROWS_WITH_AS(EDC{one},
                       "Expected len(combined_cache_data) = 1 to be 4 or 6.\ncombined_cache_data = (tensor of shape "
                       "[1, 1, 1, 1],)",
                       kvc::ValueError);
  const std::vector<std::vector<kvc::HostTensor<float>>> empty_entry{{}};
  CHECK_THROWS_WITH_AS(EDC{empty_entry},
                       "Expected len(combined_cache_data) = 0 to be 4 or 6.\ncombined_cache_data = ()",
                       kvc::ValueError);
  // no entries: two empty caches
  CHECK(EDC(std::vector<std::vector<kvc::HostTensor<float>>>{}).size() == 0);
}
